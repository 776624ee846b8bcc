#!/usr/bin/env bash
# One prepared run on a lent GPU machine (the device tool). Everything it writes lands in $OUT (or ./gpu_out).
# The machine's own torch/triton are used (no pip install there): PYTHONPATH=. is the repo.
#   STEPS="kernels selfcheck launch bench never_slower train" (the default) picks what runs, in this order:
#   kernels       python -m lowering.numerics cuda: every kernel family vs torch on the full shapes (autotuned)
#                 (what the gpu-marked tests/test_kernels_gpu.py runs)
#   selfcheck     python -m moepass selfcheck: kernels on small shapes, one step of each form, collectives
#   bench         benchmarks/kernels.py: the grouped-GEMM kernels' timings against the roofline
#   never_slower  benchmarks/never_slower.py: form="single" (Triton path) vs the untouched block, fp32 + bf16
#   train         python -m moepass train on one GPU (NCCL, W=1), single / ep / fsep, 40 steps with --reference
#   never_slower_hf  the same as never_slower over every Hugging Face family moepass rewrites (fp32, layer size)
#   never_slower_plain  never_slower with MOEPASS_PLAIN_TRITON_LAUNCH=1 (every launch through Triton's own path: the A/B
#                 of lowering/launcher.py's direct launch; NEVER_SLOWER_ARGS applies to both)
#   launch        benchmarks/launch_overhead.py: host us and Python calls per launch, Triton's path vs the direct launch
#   keeper        benchmarks/keeper_overhead.py --profile: host time of a kept block (the user's block run through a
#                 compiled one) taken apart: the compiled call, the copy's block called directly, its forward, the graph
#   pytest_gpu    the gpu-marked tests (python3 -m pytest -m gpu tests/test_kernels_gpu.py), where pytest is installed
# TRAIN_FORMS (default "single ep fsep") picks the train step's forms.
# TOTAL (seconds, default 560) bounds the whole run: each step's timeout is cut to what is left, and a step with
# under 20 s left is skipped, so the device call ends inside its limit with every finished step's files in $OUT.
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
STEPS="${STEPS:-kernels selfcheck launch bench never_slower train}"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, triton, sympy; print('torch', torch.__version__, 'triton', triton.__version__, 'sympy', sympy.__version__, torch.cuda.get_device_name())"
deadline=$(( $(date +%s) + ${TOTAL:-560} ))
left() { local want=$1 rest=$(( deadline - $(date +%s) )); echo $(( want < rest ? want : rest )); }
# never_slower SUFFIX PLAIN: the samples at layer + tiny size, MOEPASS_PLAIN_TRITON_LAUNCH=PLAIN, files named with SUFFIX
never_slower() {
  MOEPASS_PLAIN_TRITON_LAUNCH=$2 timeout "$(left "${NEVER_SLOWER_TIMEOUT:-200}")" python3 benchmarks/never_slower.py \
    --device cuda --dtypes float32,bfloat16 --sizes layer,tiny --rounds 5 --iters 20 ${NEVER_SLOWER_ARGS:-} \
    --out "$OUT/never_slower_cuda$1.json" 2>&1 | tee "$OUT/never_slower$1.log"; echo "rc=${PIPESTATUS[0]}"
}
for step in $STEPS; do
  if [ "$(left 20)" -lt 20 ]; then echo "== $step skipped: under 20 s of TOTAL=${TOTAL:-560} left"; continue; fi
  echo "== $step"; start=$(date +%s)
  case $step in
    kernels) timeout "$(left "${KERNELS_TIMEOUT:-240}")" python3 -m lowering.numerics cuda > "$OUT/kernels_gpu.log" 2>&1
             echo "rc=$?"; tail -c 4000 "$OUT/kernels_gpu.log" ;;
    selfcheck) timeout "$(left "${SELFCHECK_TIMEOUT:-300}")" python3 -m moepass selfcheck --json "$OUT/selfcheck.json" 2>&1 \
               | tee "$OUT/selfcheck.log"; echo "rc=${PIPESTATUS[0]}" ;;
    bench) timeout "$(left "${BENCH_TIMEOUT:-200}")" python3 benchmarks/kernels.py --out "$OUT/kernels.json" \
           > "$OUT/kernels_bench.log" 2>&1; echo "rc=$?"; tail -c 3000 "$OUT/kernels_bench.log" ;;
    never_slower) never_slower "" 0 ;;
    train) for form in ${TRAIN_FORMS:-single ep fsep}; do
             timeout "$(left "${TRAIN_TIMEOUT:-90}")" python3 -m moepass train --form $form --nproc 1 --device cuda --steps 40 \
               --reference --out "$OUT/train_$form" > "$OUT/train_$form.log" 2>&1; echo "train $form rc=$?"
             tail -n 3 "$OUT/train_$form.log"
           done ;;
    never_slower_hf) timeout "$(left "${NEVER_SLOWER_HF_TIMEOUT:-200}")" python3 benchmarks/never_slower.py --device cuda \
                     --dtypes float32 --sizes layer --rounds 3 --iters 10 --hf --out "$OUT/never_slower_hf_cuda.json" 2>&1 \
                     | tee "$OUT/never_slower_hf.log"; echo "rc=${PIPESTATUS[0]}" ;;
    never_slower_plain) never_slower _plain 1 ;;
    launch) timeout "$(left "${LAUNCH_TIMEOUT:-90}")" python3 benchmarks/launch_overhead.py --out "$OUT/launch_overhead.json" 2>&1 \
            | tee "$OUT/launch_overhead.log"; echo "rc=${PIPESTATUS[0]}" ;;
    keeper) timeout "$(left "${KEEPER_TIMEOUT:-120}")" python3 benchmarks/keeper_overhead.py --device cuda --sizes tiny,layer --profile \
              --out "$OUT/keeper_overhead_cuda.json" 2>&1 | tee "$OUT/keeper_overhead.log"; echo "rc=${PIPESTATUS[0]}" ;;
    pytest_gpu) if python3 -c "import pytest" 2>/dev/null; then
                  timeout "$(left "${PYTEST_GPU_TIMEOUT:-400}")" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
                    > "$OUT/pytest_gpu.log" 2>&1; echo "rc=$?"; tail -n 15 "$OUT/pytest_gpu.log"
                else echo "pytest_gpu skipped: pytest is not installed on this machine"; fi ;;
    *) echo "unknown step $step: choose from kernels selfcheck bench never_slower never_slower_plain launch keeper pytest_gpu train never_slower_hf" ;;
  esac
  echo "($step: $(( $(date +%s) - start )) s)"
done
