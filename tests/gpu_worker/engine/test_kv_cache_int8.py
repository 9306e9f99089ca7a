"""`kv_cache_dtype="int8"`: keys and values at 8 bits with a scale per token and head — about twice the tokens
in the same pool, attention within int8 rounding of the dense cache's."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import LLM, SamplingParams
from gpu_worker.engine.attention import AttentionMetadata, HeadLayout, ScaledPagedAttention
from gpu_worker.engine.cpu_attention import CpuInt8PagedAttention
from gpu_worker.engine.kernels import cpu_has_avx512_bf16
from gpu_worker.engine.kv_cache_format import ScaledKVCache, ScaledKVFormat, quantize_per_row, quantize_per_row_fp8
from services.text.errors import ModelLoadError
from tests.kernel_inputs import NATIVE_BUILDS, decode_metadata

needs_avx512_bf16 = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the native kernels need AVX512-BF16")

PROMPTS = [[5, 17, 42, 9, 33, 2, 71, 8, 120, 7] * 4, [90, 3, 3, 14] * 5]
HEAD_DIM_64 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                   initializer_range=0.02)


def test_per_row_quantization_is_within_half_a_step():
    x = torch.randn(7, 3, 64) * torch.logspace(-2, 2, 7)[:, None, None]
    q, scale = quantize_per_row(x)
    assert q.dtype == torch.int8 and scale.shape == (7, 3)
    assert bool(((q.float() * scale[..., None] - x).abs() <= scale[..., None] / 2 + 1e-6).all())


def test_fp8_per_row_quantization_keeps_e4m3_precision():
    # e4m3 keeps 3 bits of mantissa: each value within 2^-4 of itself, relative to the row's scale at the bottom.
    x = torch.randn(7, 3, 64) * torch.logspace(-2, 2, 7)[:, None, None]
    q, scale = quantize_per_row_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (7, 3)
    back = q.float() * scale[..., None]
    assert bool(((back - x).abs() <= 2 ** -4 * x.abs() + scale[..., None] * 2 ** -6).all())
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=2 ** -4)  # each row's max maps to 448


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
    llm = LLM(model, dtype="float32", kv_cache_dtype="int8", kv_cache_memory_bytes=ScaledKVFormat(
        "int8", torch.float32).bytes_per_block(2, 16, 2, 64) * 12, max_model_len=128, max_num_batched_tokens=32)
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


def _int8_cache(num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> ScaledKVCache:
    fmt = ScaledKVFormat("int8", torch.bfloat16)
    return fmt.allocate(1, num_blocks, block_size, kv_heads, head_dim, torch.device("cpu"))[0]


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
def test_native_int8_write_stores_the_references_values_and_scales_from_a_fused_qkv_slice(kernels):
    torch.manual_seed(5)
    kv_heads, head_dim, block_size, num_blocks, tokens = 4, 64, 16, 20, 37
    magnitudes = torch.logspace(-3, 2, tokens)[:, None]  # the rows' scales from tiny to large
    qkv = (torch.randn(tokens, (12 + 2 * kv_heads) * head_dim) * magnitudes).bfloat16()
    _, k, v = qkv.split([12 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    meta = AttentionMetadata(slots // block_size, slots % block_size, block_size, [], None, None, [])
    caches = [_int8_cache(num_blocks, kv_heads, block_size, head_dim) for _ in range(2)]
    layout = HeadLayout(12, kv_heads, head_dim, 1.0)
    ScaledPagedAttention(layout).write_kv(k, v, caches[0], meta)
    CpuInt8PagedAttention(layout, kernels()).write_kv(k, v, caches[1], meta)
    assert torch.equal(caches[0].data, caches[1].data) and torch.equal(caches[0].scale, caches[1].scale)
    assert caches[1].scale.count_nonzero() == 2 * tokens * kv_heads


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize("length", [1, 16, 45, 160])
def test_native_int8_gather_dequantizes_exactly_as_the_reference(kernels, length):
    torch.manual_seed(length)
    kv_heads, head_dim, block_size, num_blocks = 3, 64, 16, 40
    cache = _int8_cache(num_blocks, kv_heads, block_size, head_dim)
    cache.data.copy_(torch.randint(-127, 128, cache.data.shape, dtype=torch.int8))
    cache.scale.copy_((torch.rand(cache.scale.shape) * 0.05 + 1e-3).bfloat16())
    tables = torch.stack([torch.randperm(num_blocks)[:10] for _ in range(3)])  # three sequences' blocks
    layout = HeadLayout(kv_heads, kv_heads, head_dim, 1.0)
    want = ScaledPagedAttention(layout).gather(cache, tables, length)
    got = CpuInt8PagedAttention(layout, kernels()).gather(cache, tables, length)
    for w, g in zip(want, got, strict=True):
        assert g.shape == (3, kv_heads, length, head_dim) and g.dtype == torch.bfloat16
        assert torch.equal(w, g)


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 4, 64), (8, 8, 32), (16, 2, 128)])
def test_native_int8_decode_attention_matches_the_dequantizing_reference(kernels, heads, kv_heads, head_dim):
    torch.manual_seed(heads)
    block_size, num_blocks = 16, 200
    cache = _int8_cache(num_blocks, kv_heads, block_size, head_dim)
    cache.data.copy_(torch.randint(-127, 128, cache.data.shape, dtype=torch.int8))
    cache.scale.copy_((torch.rand(cache.scale.shape) * 0.05 + 1e-3).bfloat16())
    context_lens = [1, 17, 300, 64, 5, 129]
    q = torch.randn(len(context_lens), heads, head_dim, dtype=torch.bfloat16)
    meta = decode_metadata(context_lens, num_blocks, block_size)
    layout = HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5)
    want = ScaledPagedAttention(layout).decode(q.float(), ScaledKVCache(cache.data, cache.scale.float()), meta)
    got = CpuInt8PagedAttention(layout, kernels()).decode(q, cache, meta)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).abs() <= 1e-2 * want.abs() + 1e-2 * want.abs().max()).all()


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
def test_an_int8_decode_step_in_one_native_call_writes_and_attends_as_the_reference(kernels):
    from gpu_worker.engine.rope import RotaryEmbedding

    torch.manual_seed(9)
    heads, kv_heads, head_dim, block_size, num_blocks, context_lens = 9, 3, 64, 16, 60, [1, 17, 300, 64]
    meta = decode_metadata(context_lens, num_blocks, block_size)
    layout = HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5)
    qkv = torch.randn(len(context_lens), (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, {}).cos_sin(meta.decode_context_lens - 1, torch.bfloat16)
    caches = [_int8_cache(num_blocks, kv_heads, block_size, head_dim) for _ in range(2)]
    for cache in caches:
        cache.data.copy_(torch.randint(-127, 128, cache.data.shape, generator=torch.Generator().manual_seed(1),
                                       dtype=torch.int8))
        cache.scale.fill_(0.02)
    want = ScaledPagedAttention(layout)(qkv.clone(), cos, sin, caches[0], meta)
    got = CpuInt8PagedAttention(layout, kernels())(qkv.clone(), cos, sin, caches[1], meta)
    assert got.shape == (len(context_lens), heads * head_dim) and got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs() <= 1e-2 * want.float().abs() + 1e-2 * want.float().abs().max()).all()
    assert torch.equal(caches[0].data, caches[1].data) and torch.equal(caches[0].scale, caches[1].scale)
    assert not torch.equal(caches[1].scale, torch.full_like(caches[1].scale, 0.02))  # this step's rows written


@needs_avx512_bf16
def test_bf16_serving_reads_the_int8_cache_natively_and_scores_as_the_reference_does(make_checkpoint):
    model = str(make_checkpoint("llama", **HEAD_DIM_64))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    native = LLM(model, dtype="bfloat16", kv_cache_dtype="int8")
    assert isinstance(native.engine.runner.model.layers[0].self_attn.attn, CpuInt8PagedAttention)
    reference = LLM(model, dtype="bfloat16", kv_cache_dtype="int8")
    for layer in reference.engine.runner.model.layers:
        layer.self_attn.attn = ScaledPagedAttention(layer.self_attn.attn.heads)
    got, want = native.generate(PROMPTS, params), reference.generate(PROMPTS, params)
    same = sum(a == b for o, r in zip(got, want, strict=True) for a, b in zip(o.token_ids, r.token_ids, strict=True))
    assert same >= 0.9 * sum(len(o.token_ids) for o in want)  # bf16 near-ties may flip a token, no more
