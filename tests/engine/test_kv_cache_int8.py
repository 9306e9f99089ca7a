"""`kv_cache_dtype="int8"`: keys and values at 8 bits with a scale per token and head — about twice the tokens
in the same pool, attention within int8 rounding of the dense cache's."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import LLM, SamplingParams
from gpu_worker.engine.errors import ModelLoadError
from gpu_worker.engine.kv_cache_format import Int8KVFormat, quantize_per_row

PROMPTS = [[5, 17, 42, 9, 33, 2, 71, 8, 120, 7] * 4, [90, 3, 3, 14] * 5]
HEAD_DIM_64 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                   initializer_range=0.02)


def test_per_row_quantization_is_within_half_a_step():
    x = torch.randn(7, 3, 64) * torch.logspace(-2, 2, 7)[:, None, None]
    q, scale = quantize_per_row(x)
    assert q.dtype == torch.int8 and scale.shape == (7, 3)
    assert bool(((q.float() * scale[..., None] - x).abs() <= scale[..., None] / 2 + 1e-6).all())


def test_an_int8_pool_holds_more_than_1_9x_the_tokens_of_a_bf16_one(make_checkpoint):
    model = str(make_checkpoint("llama", **HEAD_DIM_64))
    budget = dict(dtype="bfloat16", kv_cache_memory_bytes=32 << 20)
    dense = LLM(model, **budget).engine.kv.pool.num_blocks
    int8 = LLM(model, kv_cache_dtype="int8", **budget).engine.kv.pool.num_blocks
    assert int8 / dense > 1.9


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_cache_scores_prompts_as_the_dense_cache_does_within_its_rounding(make_checkpoint, arch):
    model = str(make_checkpoint(arch, **HEAD_DIM_64))
    # Chunks of 16 tokens: every chunk after the first attends to what the cache holds.
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs(**kwargs):
        outs = LLM(model, dtype="float32", max_num_batched_tokens=16, **kwargs).generate(PROMPTS, params)
        return torch.tensor([v for o in outs for v in o.prompt_logprobs[1:]])

    dense, int8 = logprobs(), logprobs(kv_cache_dtype="int8")
    assert not torch.equal(dense, int8)  # the cache really is read at 8 bits
    assert (int8 - dense).abs().max() < 0.05


def test_decoding_with_prefix_caching_and_preemption_runs_on_an_int8_cache(make_checkpoint):
    model = str(make_checkpoint("llama", **HEAD_DIM_64))
    llm = LLM(model, dtype="float32", kv_cache_dtype="int8", kv_cache_memory_bytes=Int8KVFormat(
        torch.float32).bytes_per_block(2, 16, 2, 64) * 12, max_model_len=128, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)  # prompts' blocks now come from the prefix cache
    assert [c.token_ids for o in first for c in o.outputs] == [c.token_ids for o in again for c in o.outputs]
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(len(c.token_ids) == 40 for o in first for c in o.outputs)


def test_fp8_cache_on_cpu_is_refused_with_the_reason(make_checkpoint):
    with pytest.raises(ModelLoadError, match="CUDA"):
        LLM(str(make_checkpoint("llama")), kv_cache_dtype="fp8")


def test_unknown_kv_cache_dtype_is_refused(make_checkpoint):
    with pytest.raises(ValueError, match="auto, int8, fp8"):
        LLM(str(make_checkpoint("llama")), kv_cache_dtype="int4")
