# Cross-compiles for AArch64 Linux with Debian's g++-aarch64-linux-gnu and
# runs the results under qemu-user (no binfmt_misc needed).
#
#   cmake -S . -B build-aarch64 --toolchain cmake/toolchain-aarch64.cmake
#
# Dependencies come from Debian multiarch packages (dpkg --add-architecture
# arm64; libgtest-dev:arm64 libgmock-dev:arm64 libxxhash-dev:arm64
# liburing-dev:arm64, and libstdc++6:arm64 to run the tests). Boost.Interprocess is header-only: the host's
# /usr/include/boost serves both architectures. scripts/aarch64.sh installs
# all of it.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(SHMCAST_CROSS_TRIPLE aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${SHMCAST_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${SHMCAST_CROSS_TRIPLE}-g++)
# Debian's cross compilers use sysroot "/" with multiarch directories:
# libraries are found in /usr/lib/aarch64-linux-gnu, headers in /usr/include.
set(CMAKE_LIBRARY_ARCHITECTURE ${SHMCAST_CROSS_TRIPLE})

# pkg-config must read the arm64 .pc files only (libxxhash, liburing); the
# host's x86-64 ones would otherwise be found first.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/${SHMCAST_CROSS_TRIPLE}/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")

# Build-time tools (none today) run on the host; libraries and packages are
# searched for the target only.
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)

# Everything CMake runs for the target (gtest_discover_tests at build time,
# ctest, add_test commands naming a target) goes through qemu-user.
#
# "-L /": the programs run on the arm64 multiarch runtime (libc6:arm64,
# libstdc++6:arm64: /lib/ld-linux-aarch64.so.1 and /lib/aarch64-linux-gnu),
# where the dynamic loader and libc.so.6 come from one package. Not
# "-L /usr/aarch64-linux-gnu": that prefix holds libc6-arm64-cross's loader
# (2.36-8cross1 on Debian 12), which finds no libxxhash there, searches
# /lib/aarch64-linux-gnu and so loads the multiarch libc.so.6
# (2.36-9+deb12uN): a loader and libc from different builds disagree on
# glibc's private data (rtld_global), and the first fork() loops forever in
# the child (reclaim_stacks walking a list it cannot terminate). An explicit
# "/" also overrides any QEMU_LD_PREFIX or /etc/qemu-binfmt/aarch64 link.
find_program(SHMCAST_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static)
if(SHMCAST_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR "${SHMCAST_QEMU_AARCH64};-L;/")
else()
  message(WARNING "qemu-aarch64 not found: the AArch64 tests can be built but not run (apt-get install qemu-user)")
endif()
