# Sourced by the GPU scripts (bench/sharded_device.sh, bench/store_device.sh)
# on the device machine: logs everything to $OUT/$DEVICE_LOG, unpacks the
# carried .debs (scripts/device-env.sh), records the machine in
# $OUT/env.log, and builds the Python module with CUDA into $B
# (/tmp/shmcast-build); then PY is the interpreter and PYTHONPATH holds the
# module. Defines log(). Needs DEVICE_LOG; exits 1 when the build fails.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$DEVICE_LOG") 2>&1
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*"; }
B=/tmp/shmcast-build
source scripts/device-env.sh >"$OUT/env.log" 2>&1
PY=$(command -v python3)
PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
export PATH=/usr/local/cuda/bin:$PATH
{ nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv;
  nvidia-smi topo -m | head -4; lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)"; free -g | head -2;
  df -h /dev/shm /var/tmp; $PY -c "import torch; print('torch', torch.__version__)"; } >>"$OUT/env.log" 2>&1
log build
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" \
    ${PB:+-Dpybind11_DIR=$PB} -DSHMCAST_BUILD_TESTS=OFF -DSHMCAST_BUILD_TOOLS=OFF \
  && cmake --build $B -j"$(nproc)" --target _shmcast; } >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
