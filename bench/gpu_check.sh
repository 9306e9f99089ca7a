#!/usr/bin/env bash
# One prepared GPU check, nothing fetched from the network: the Triton kernels against their torch references on
# CUDA, the engine's exactness on CUDA (HF float32 greedy, bf16 top-5, CUDA graphs on = off, preemption and prefix
# caching, one host sync per step, the KV pool at gpu_memory_utilization 0.9), then bench/gpu.py on a
# Llama-3-8B-shaped random bf16 checkpoint: batch-1 decode against the HBM roofline, 64 concurrent requests
# against HF generate with and without CUDA graphs, each kernel's achieved bandwidth; then where a decode step's
# time goes (bench/lab/gpu_profile.py: host parts, graph replay, GPU time by kernel). Stops at the first failing
# stage and names it; each stage is time-boxed, the whole run at most 10 minutes. Prints one table; JSON in $OUT.
#   bash bench/gpu_check.sh            (uses python3; set PY to choose another)
#   KEEP_GOING=1 bash bench/gpu_check.sh   (for a lease too short to try twice: every stage runs, failures named)
#   STAGES="checkpoint benchmark" bash bench/gpu_check.sh   (only these stages)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TOKENFLEET_CACHE_DIR=${TOKENFLEET_CACHE_DIR:-/tmp/tokenfleet-cache}
OUT=${OUT:-/tmp/tokenfleet-gpu-check}; mkdir -p "$OUT"
CHECKPOINT=/tmp/llama3-8b-random
PYTEST="$PY -m pytest -q -p no:cacheprovider -o addopts= $([ -n "${KEEP_GOING:-}" ] && echo --maxfail=5 || echo -x)"
started=$(date +%s)
failed=()
# The kernel tests compile a Triton kernel per shape and dtype: in parallel processes where pytest-xdist is there.
WORKERS=$($PY -c 'import xdist' 2>/dev/null && echo "-n 8" || true)

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2 began
  shift 2
  if [ -n "${STAGES:-}" ] && [[ " $STAGES " != *" $name "* ]]; then return; fi
  began=$(date +%s)
  echo "== $name (at most ${limit} s)"
  if ! timeout --kill-after=10 "$limit" bash -c "set -euo pipefail; $*" 2>&1 | tee "$OUT/$name.log" | tail -n 40; then
    echo "FAILED at stage: $name (log: $OUT/$name.log)"
    [ -n "${KEEP_GOING:-}" ] || exit 1
    failed+=("$name")
  fi
  echo "   $name: $(( $(date +%s) - began )) s"
}

stage environment 15 "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import torch, triton, transformers; assert torch.cuda.is_available(), \"torch sees no GPU\";
print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__)'"

stage kernels 90 "$PYTEST $WORKERS tests/gpu_worker/engine/*triton*.py"

stage exactness 130 "$PYTEST tests/gpu_worker/engine/test_cuda.py
  $PYTEST tests/gpu_worker/engine/test_matches_hf.py -k 'bfloat16 or logprobs or (concurrency and 32)'"

stage checkpoint 60 "$PY -m bench.make_checkpoint --shape llama3-8b --out $CHECKPOINT --device cuda"

stage benchmark 240 "$PY -m bench.gpu --model $CHECKPOINT --device cuda --json $OUT/gpu_bench.json"

stage profile 90 "$PY -m bench.lab.gpu_profile --model $CHECKPOINT --json $OUT/gpu_profile.json"

if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: failed stages: ${failed[*]}; $(( $(date +%s) - started )) s"
  exit 1
fi
echo "gpu_check: every stage passed in $(( $(date +%s) - started )) s; figures above and in $OUT/gpu_bench.json"
