"""A request resumed on another engine from the tokens already delivered (a worker died mid-request) continues
with the tokens of the uninterrupted run: in bf16 with batch-invariant mode, and on these checkpoints in float32.

The resuming engine prefills the prompt and the delivered tokens again, where the uninterrupted run computed the
delivered tokens one decode step at a time. Batch-invariant mode computes every token's keys, values and logits
with the same ops either way, so this holds by construction. float32 runs other kernels for a prefill than for a
decode; its rounding stays far below these checkpoints' logit gaps, though a near-tie elsewhere can still flip.
bf16 with the default kernels moves the logits' last bits enough to change the text, so no test claims it.
"""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.engine import LLM, ResumedChoice, SamplingParams
from gpu_worker.engine.kernels import cpu_kernels

# The resuming engine prefills the 90-token prompt and the k delivered tokens in chunks of at most 64 tokens into
# 16-token blocks: the cuts end that prefill inside a block, on a block's end, and one token into a third chunk.
ENGINE = dict(max_num_batched_tokens=64, block_size=16, kv_cache_memory_bytes=64 << 20, max_model_len=256)
CUTS = (1, 6, 25, 39)
MAX_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)

needs_bf16_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="batch-invariant mode needs AVX512-BF16")


@pytest.fixture(scope="module", params=[
    pytest.param(dict(dtype="float32"), id="float32"),
    pytest.param(dict(dtype="bfloat16", deterministic=True), id="batch-invariant-bf16", marks=needs_bf16_kernels),
])
def engines(request, make_checkpoint):
    """(the engine that ran uninterrupted, one to resume on): two workers serving the same model. The second
    caches no prefix, so each resume computes all its tokens again rather than find an earlier resume's blocks."""
    # bf16 weights with head_dim 32, what the batch-invariant attention takes.
    checkpoint = str(make_checkpoint("llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256))
    return (LLM(checkpoint, **request.param, **ENGINE),
            LLM(checkpoint, **request.param, **ENGINE, enable_prefix_caching=False))


def _resumed(llm: LLM, prompt: list[int], params: SamplingParams, delivered: list[int]) -> list[int]:
    """The tokens after `delivered`, resumed as the worker resumes: the choice's tokens from its reply stream."""
    engine = llm.engine
    engine.add_request("resumed", prompt, params, resume=[ResumedChoice(0, delivered, 0)])
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    return tokens


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_resumed_after_k_delivered_tokens_continues_as_the_uninterrupted_run(engines, params):
    uninterrupted, resuming = engines
    prompt = [random.Random(7).randrange(10, 30000) for _ in range(90)]
    full = uninterrupted.generate(prompt, params)[0].token_ids
    assert len(set(full)) > MAX_TOKENS // 2  # varied enough that a dropped or repeated token shows
    for k in CUTS:
        assert full[:k] + _resumed(resuming, prompt, params, full[:k]) == full, f"resumed after {k} tokens"
