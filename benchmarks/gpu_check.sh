#!/usr/bin/env bash
# One prepared run on a lent GPU machine (the device tool): versions, the per-family kernel numerics on
# CUDA (tests/_kernels_gpu.py, compiled Triton), the grouped-GEMM kernel timings (benchmarks/kernels.py)
# and `python -m moepass selfcheck` when it exists. Everything it writes lands in $OUT (or ./gpu_out).
# The machine's own torch/triton are used (no pip install there): PYTHONPATH=. is the repo.
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, triton, sympy; print('torch', torch.__version__, 'triton', triton.__version__, 'sympy', sympy.__version__, torch.cuda.get_device_name())"
echo "== kernels_gpu"; timeout "${KERNELS_TIMEOUT:-240}" python3 tests/_kernels_gpu.py cuda > "$OUT/kernels_gpu.log" 2>&1; echo "rc=$?"
tail -c 4000 "$OUT/kernels_gpu.log"
if python3 -c "import moepass.selfcheck" 2>/dev/null; then
  echo "== selfcheck"; timeout "${SELFCHECK_TIMEOUT:-300}" python3 -m moepass selfcheck --json "$OUT/selfcheck.json" 2>&1 | tee "$OUT/selfcheck.log"; echo "rc=$?"
fi
echo "== kernel timings"; timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/kernels.py --out "$OUT/kernels.json" > "$OUT/kernels_bench.log" 2>&1; echo "rc=$?"
tail -c 3000 "$OUT/kernels_bench.log"
