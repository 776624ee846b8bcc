#!/usr/bin/env bash
# One prepared run on a lent GPU machine (the device tool): versions, the per-family kernel numerics on
# CUDA (lowering/numerics.py, compiled Triton), the grouped-GEMM kernel timings (benchmarks/kernels.py)
# and `python -m moepass selfcheck`. Everything it writes lands in $OUT (or ./gpu_out).
# The machine's own torch/triton are used (no pip install there): PYTHONPATH=. is the repo.
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, triton, sympy; print('torch', torch.__version__, 'triton', triton.__version__, 'sympy', sympy.__version__, torch.cuda.get_device_name())"
# ONLY=selfcheck: just `python -m moepass selfcheck` (it checks every kernel family on small shapes itself)
if [ "${ONLY:-}" != "selfcheck" ]; then
  echo "== kernels_gpu"; timeout "${KERNELS_TIMEOUT:-240}" python3 -m lowering.numerics cuda > "$OUT/kernels_gpu.log" 2>&1; echo "rc=$?"
  tail -c 4000 "$OUT/kernels_gpu.log"
fi
echo "== selfcheck"; timeout "${SELFCHECK_TIMEOUT:-300}" python3 -m moepass selfcheck --json "$OUT/selfcheck.json" 2>&1 | tee "$OUT/selfcheck.log"; echo "rc=${PIPESTATUS[0]}"
[ "${ONLY:-}" = "selfcheck" ] && exit 0
echo "== kernel timings"; timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/kernels.py --out "$OUT/kernels.json" > "$OUT/kernels_bench.log" 2>&1; echo "rc=$?"
tail -c 3000 "$OUT/kernels_bench.log"
