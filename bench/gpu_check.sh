#!/usr/bin/env bash
# One prepared GPU check, no network: kernels and engine on CUDA against the torch / HF references, then
# `bench engine` on a Llama-3-8B-shaped random bf16 checkpoint. Prints one table; about 6-8 minutes on an H200.
#   bash bench/gpu_check.sh            (uses python3; set PY to choose another)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TOKENFLEET_CACHE_DIR=${TOKENFLEET_CACHE_DIR:-/tmp/tokenfleet-cache}
OUT=${OUT:-/tmp/tokenfleet-gpu-check}; mkdir -p "$OUT"

echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

echo "== exactness on cuda (float32 greedy == HF generate; logprobs; bf16 top-5 rule)"
TOKENFLEET_TEST_DEVICE=cuda timeout 240 $PY -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/engine/test_matches_hf.py 2>&1 | tail -n 4

echo "== Triton kernels on cuda against their references (w8a16 / w4a16 GEMM, paged decode over int8 KV)"
timeout 120 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/test_quant_triton.py \
    tests/engine/test_triton_paged_attention.py 2>&1 | tail -n 4

echo "== quantized linears on cuda: fp8 (_scaled_mm), int8 / int4 (Triton) vs bf16; decode attention bf16 / int8 KV"
timeout 150 $PY -m bench.quant_kernels --device cuda --rows 1,16,128 --rounds 5 --attention 2>&1 | tail -n 36

echo "== Llama-3-8B-shaped checkpoint (random bf16 weights)"
timeout 180 $PY -m bench.make_checkpoint --shape llama3-8b --out /tmp/llama3-8b-random --device cuda

echo "== bench engine on cuda"
timeout 300 $PY -m services.cli bench engine --model /tmp/llama3-8b-random --device cuda --dtype bf16 \
    --num-requests 128 --repeats 3 --peer hf --json "$OUT/gpu_bench.json"
