#!/usr/bin/env bash
# The GPU checks of nb_dist in one go (for a lent GPU machine): the device, the CUDA tests
# under pytest, the GPU scenarios (bench/gpu_scenarios.py) and the NCCL benchmark
# (bench/nccl_allreduce.py). Logs go to $OUT (or ./gpu_check_out). Wheels for what the machine
# lacks (jupyter_client, ipykernel, ...) are installed from .whl/ when that folder exists.
set -u
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PY:-python3}
if [ -z "${NO_WHL:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
T0=$(date +%s)
stamp() { echo "--- $1 (t+$(( $(date +%s) - T0 )) s)"; }

stamp device | tee "$OUT/device.log"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  $PY - <<'EOF'
import sys, torch, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None)
for m in ("jupyter_client", "ipykernel", "psutil", "cloudpickle", "pytest", "pytest_timeout"):
    try:
        mod = __import__(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", e)
EOF
} 2>&1 | tee -a "$OUT/device.log"

stamp pytest | tee "$OUT/pytest.log"
# addopts of pyproject name nbval (not needed here): replaced. The CUDA tests first (gpu
# marker), then the modules that hold CUDA pre-flight tests, whole.
timeout 200 $PY -m pytest -o addopts="" -p no:cacheprovider -ra -q --timeout 120 \
  -k "cuda or gpu or probe or preflight or poison or hooks or device" \
  tests/test_preflight.py tests/test_cuda_probe.py tests/test_torch_hooks.py 2>&1 \
  | tee -a "$OUT/pytest.log"
echo "pytest rc=${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"

stamp scenarios | tee "$OUT/scenarios.log"
timeout 240 $PY bench/gpu_scenarios.py 2>&1 | tee -a "$OUT/scenarios.log"
echo "scenarios rc=${PIPESTATUS[0]}" | tee -a "$OUT/scenarios.log"

stamp bench | tee "$OUT/bench.log"
timeout 120 $PY bench/nccl_allreduce.py ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
stamp done
