#!/usr/bin/env bash
# A short GPU check on the lent machine (one H200 is enough), in one call:
#   run: bash scripts/device-gpu-check.sh      carry: [".deb"]
# Builds everything with CUDA and the Python module, then runs the gpu ctest
# tier, the sharded multi-process tests of the CUDA build, and the CUDA and
# sharded Python tests. Logs go to $OUT (gpu-check.log, build.log, ctest.log).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
log() { echo "== $(date +%T) $*"; }
source scripts/device-env.sh >/dev/null
PY=$(command -v python3)
PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
B=/tmp/shmcast-gpu-check
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
log build
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" ${PB:+-Dpybind11_DIR=$PB} -DSHMCAST_BUILD_RELAY=OFF \
  && cmake --build $B -j"$(nproc)"; } >"$OUT/build.log" 2>&1 || { grep -E "error|Error" -A3 "$OUT/build.log" | head -40; exit 1; }
log "ctest: gpu tier, sharded multi-process tests"
(cd $B && timeout 300 ctest -L gpu --output-on-failure --timeout 240 -j4 ; \
          timeout 300 ctest -R "Sharded" -j8 --output-on-failure --timeout 240) >"$OUT/ctest.log" 2>&1
grep -E "tests passed|tests failed|\*\*\*Failed|Skipped|Not Run" "$OUT/ctest.log" | head -20
log "pytest: test_cuda.py, test_sharded.py"
(cd $B/python && timeout 400 $PY -m pytest -q -ra -p no:cacheprovider "$OLDPWD/python/tests/test_cuda.py" \
   "$OLDPWD/python/tests/test_sharded.py" 2>&1 | tail -15)
log done
