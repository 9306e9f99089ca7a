"""Batch-invariant mode (`deterministic=True`): a request's tokens do not depend on what else shares its batch.

In bf16 on CPU the default kernels change with the step's rows (a one-row GEMV or oneDNN's matmul, prefill chunk
boundaries set by the shared token budget), which moves the logits' last bits and can flip a near-tie; run this
file's burst check with `deterministic=False` and the seeded request here comes out otherwise in every burst.
"""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.engine.kernels import cpu_kernels
from gpu_worker.engine.linear import GEMV_ROWS
from gpu_worker.engine.llm import LLM
from gpu_worker.engine.sampling_params import SamplingParams
from services.text.errors import ModelLoadError

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="batch-invariant mode needs AVX512-BF16")

BUDGET = 64  # tokens per step: the target's 90-token prompt is chunked, where depends on what shares the step
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _checkpoint(make_checkpoint):
    # head_dim 32, what the native attention takes; two layers keep it quick.
    return str(make_checkpoint("llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256))


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 30000) for _ in range(n)]


def _bursts(target: list[int]) -> list[tuple[list[list[int]], int]]:
    """(other prompts, where the target goes among them): counts and lengths that put the target's prefill chunks
    at other offsets, decode it with from 2 to more than GEMV_ROWS others, and give it prefix-cache hits."""
    rng = random.Random(5)
    shares_prefix = [target[:48] + _prompt(rng, n) for n in (7, 30)]
    return [
        ([_prompt(rng, n) for n in (5, 41)], 1),
        ([_prompt(rng, n) for n in (3, 17, 150, 9, 60, 2, 33, 77)], 8),
        ([_prompt(rng, n) for n in (120, 1, 12, 55, 8, 64, 100, 4, 26, 90)] + shares_prefix, 0),
        ([_prompt(rng, n) for n in (63, 11, 47, 6)], 2),
    ]


def _tokens_in_bursts(llm: LLM, target: list[int]) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(9)
    results = []
    for others, at in _bursts(target):
        prompts = others[:at] + [target, target] + others[at:]
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(2, 30), ignore_eos=True)
                  for i in range(len(others))]
        outs = llm.generate(prompts, params[:at] + [SEEDED, GREEDY] + params[at:])
        results.append((outs[at].token_ids, outs[at + 1].token_ids))
    return results


def test_a_seeded_and_a_greedy_request_give_the_same_tokens_alone_and_in_any_burst(make_checkpoint):
    llm = LLM(_checkpoint(make_checkpoint), dtype="bfloat16", deterministic=True, max_num_batched_tokens=BUDGET)
    target = _prompt(random.Random(1), 90)
    alone = (llm.generate(target, SEEDED)[0].token_ids, llm.generate(target, GREEDY)[0].token_ids)
    assert len(alone[0]) == len(alone[1]) == 20
    assert llm.generate(target, SEEDED)[0].token_ids == alone[0]  # again alone, its prefix now cached
    assert len(_bursts(target)[1][0]) > GEMV_ROWS
    for seeded, greedy in _tokens_in_bursts(llm, target):
        assert (seeded, greedy) == alone


def test_an_int8_kv_cache_is_batch_invariant_too(make_checkpoint):
    llm = LLM(_checkpoint(make_checkpoint), dtype="bfloat16", deterministic=True, kv_cache_dtype="int8",
              max_num_batched_tokens=BUDGET)
    target = _prompt(random.Random(2), 90)
    alone = (llm.generate(target, SEEDED)[0].token_ids, llm.generate(target, GREEDY)[0].token_ids)
    assert _tokens_in_bursts(llm, target)[1:3] == [alone, alone]


def test_a_request_preempted_and_recomputed_gives_the_same_tokens(make_checkpoint):
    """A KV pool of 30 blocks (16 tokens each) for a burst of 6 requests of 90-114 tokens: sequences are preempted
    and recompute their prompt and output as prefill, which attends row by row as their decodes did."""
    llm = LLM(_checkpoint(make_checkpoint), dtype="bfloat16", deterministic=True, max_model_len=256, block_size=16,
              kv_cache_memory_bytes=30 * 2 * 2 * 16 * 2 * 32 * 2)  # blocks x layers x (K, V) x tokens x heads x D x 2 B
    rng = random.Random(3)
    prompts = [_prompt(rng, 90) for _ in range(6)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True) for i in range(6)]
    alone = [llm.generate(p, q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    assert llm.engine.scheduler.num_preemptions == 0
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("engine_args", [dict(dtype="float32"), dict(dtype="bfloat16", quantization="int8")])
def test_deterministic_mode_is_refused_where_its_kernels_do_not_serve(make_checkpoint, engine_args):
    with pytest.raises(ModelLoadError, match="deterministic"):
        LLM(_checkpoint(make_checkpoint), deterministic=True, **engine_args)
