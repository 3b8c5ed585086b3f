# Sourced by the GPU-machine scripts (bench/device_run.sh, bench/e2e/device_run.sh,
# python/device_run.sh, scripts/device-final.sh). The lent GPU machine has no
# network: Debian packages it lacks are fetched here beforehand,
#   mkdir -p .deb && cd .deb && apt-get download libxxhash-dev libxxhash0 libcli11-dev \
#     nlohmann-json3-dev libboost1.74-dev libgtest-dev libseccomp-dev libseccomp2 \
#     liburing-dev liburing2 pkgconf-bin libpkgconf3
# carried (carry: [".deb"]), and unpacked into /tmp/pfx, never into /. Exports
# CMAKE_PREFIX_PATH, PKG_CONFIG_PATH, CPATH, LIBRARY_PATH, LD_LIBRARY_PATH.
PFX=/tmp/pfx
mkdir -p $PFX
_unpack() { for p in "$@"; do for f in .deb/${p}_*.deb; do [ -f "$f" ] && dpkg -x "$f" $PFX && echo "unpacked $f"; done; done; }
[ -f /usr/include/xxhash.h ] || [ -f $PFX/usr/include/xxhash.h ] || _unpack libxxhash-dev libxxhash0
[ -d /usr/include/CLI ] || [ -d $PFX/usr/include/CLI ] || _unpack libcli11-dev
[ -d /usr/include/nlohmann ] || [ -d $PFX/usr/include/nlohmann ] || _unpack nlohmann-json3-dev
[ -d /usr/include/boost/interprocess ] || [ -d $PFX/usr/include/boost/interprocess ] || _unpack libboost1.74-dev
[ -e /usr/lib/x86_64-linux-gnu/libgtest.a ] || [ -e /usr/lib/libgtest.a ] || [ -e /usr/local/lib/libgtest.a ] ||
  [ -e $PFX/usr/lib/x86_64-linux-gnu/libgtest.a ] || _unpack libgtest-dev
[ -f /usr/include/seccomp.h ] || [ -f $PFX/usr/include/seccomp.h ] || _unpack libseccomp-dev libseccomp2
[ -f /usr/include/liburing.h ] || [ -f $PFX/usr/include/liburing.h ] || _unpack liburing-dev liburing2
if ! command -v pkg-config >/dev/null && ! command -v pkgconf >/dev/null; then
  _unpack pkgconf-bin libpkgconf3
  export PKG_CONFIG=$PFX/usr/bin/pkgconf
fi
if [ -d $PFX/usr ]; then
  for pc in $PFX/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc $PFX/usr/share/pkgconfig/*.pc; do
    [ -f "$pc" ] && sed -i "s#=/usr\b#=$PFX/usr#" "$pc"   # prefix=, libdir=, includedir=
  done
  export CMAKE_PREFIX_PATH=$PFX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export PKG_CONFIG_PATH=$PFX/usr/lib/x86_64-linux-gnu/pkgconfig:$PFX/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export CPATH=$PFX/usr/include${CPATH:+:$CPATH}
  export LIBRARY_PATH=$PFX/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$PFX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
