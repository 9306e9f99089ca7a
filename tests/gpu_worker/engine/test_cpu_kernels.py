"""Each CPU kernel agrees with its torch reference on the same bf16 data."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.engine import LLM, EngineConfig
from gpu_worker.engine.attention import AttentionMetadata, HeadLayout, TorchPagedAttention
from gpu_worker.engine.cpu_attention import (
    CpuInt8PagedAttention,
    CpuPagedAttention,
    NativePrefillAttention,
    WidenedDecodeAttention,
)
from gpu_worker.engine.kernel_choice import choose_kernels
from gpu_worker.engine.kernels import (
    AMX_BF16_FLAGS,
    AVX2_FLAGS,
    avx2_kernels,
    cpu_family,
    cpu_has,
    cpu_has_avx512_bf16,
    cpu_kernels,
    cpu_model,
    quant_cpu_kernels,
)
from gpu_worker.engine.linear import (
    GemvPlan,
    Linear,
    OneDnnPackedLinearKernel,
    RowInvariantBf16LinearKernel,
    TorchLinearKernel,
    WidenedBf16LinearKernel,
    onednn_packs_bf16,
)
from tests.kernel_inputs import NATIVE_BUILDS, decode_metadata, mixed_step

needs_avx512_bf16 = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the native kernels need AVX512-BF16")


def kernels_for(dtype: torch.dtype, **options):
    """The kernels an engine on this CPU chooses in `dtype` with these `EngineConfig` options."""
    return choose_kernels(EngineConfig("", **options), dtype)


def _assert_close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: outputs may differ from an fp32 reference by its rounding, no more.
    assert ((got.float() - want.float()).abs() <= 1e-2 * want.float().abs() + 1e-2 * want.float().abs().max()).all()


@needs_avx512_bf16
def test_native_kernels_build_on_this_cpu():
    assert cpu_kernels() is not None, "gpu_worker/engine/kernels/cpu_kernels.cpp failed to build"


GEMV_PLANS = [GemvPlan(), GemvPlan(2, 0), GemvPlan(4, 0), GemvPlan(1, 0), GemvPlan(3, 5)]


@needs_avx512_bf16
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_few_row_gemv_matches_the_reference(rows):
    torch.manual_seed(rows)
    for n, k in [(1280, 768), (7, 64), (32000, 256)]:
        w = torch.randn(n, k, dtype=torch.bfloat16)
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        plan = GemvPlan()
        _assert_close_in_bf16(cpu_kernels().gemv_bf16(x, w, plan.streams, plan.prefetch_rows),
                              F.linear(x.float(), w.float()))


@needs_avx512_bf16
@pytest.mark.parametrize("rows", [1, 3])
def test_every_gemv_plan_gives_the_same_bits(rows):
    torch.manual_seed(rows)
    for n, k in [(1280, 768), (7, 64), (2, 32)]:  # down to fewer rows than threads times streams
        w = torch.randn(n, k, dtype=torch.bfloat16)
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        first, *others = [cpu_kernels().gemv_bf16(x, w, p.streams, p.prefetch_rows) for p in GEMV_PLANS]
        for other in others:
            assert torch.equal(other, first)


@needs_avx512_bf16
def test_the_row_invariant_product_gives_each_row_the_same_bits_whatever_rows_share_it():
    """Batch-invariant mode's linear: a row's output is the same for any number of rows and any row around it
    (tiles of 1-4 rows by up to 16 weight rows, and blocks of 16 weight rows cut short)."""
    torch.manual_seed(0)
    for n, k in [(96, 256), (37, 96), (5, 32)]:
        w = torch.randn(n, k, dtype=torch.bfloat16)
        x = torch.randn(41, k, dtype=torch.bfloat16)
        every = cpu_kernels().rowwise_mm_bf16(x, w)
        _assert_close_in_bf16(every, F.linear(x.float(), w.float()))
        for start, rows in [(0, 1), (3, 2), (7, 3), (1, 4), (10, 5), (2, 9), (20, 21)]:
            assert torch.equal(cpu_kernels().rowwise_mm_bf16(x[start:start + rows].contiguous(), w),
                               every[start:start + rows])


@needs_avx512_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_batch_invariant_packing_serves_every_row_count_with_the_row_invariant_kernel(bias):
    torch.manual_seed(1)
    layer = Linear(128, 64, bias=bias).to(torch.bfloat16)
    layer.pack(kernels_for(torch.bfloat16, deterministic=True))
    assert isinstance(layer.kernel, RowInvariantBf16LinearKernel)
    x = torch.randn(12, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        every = layer(x)
        _assert_close_in_bf16(every, F.linear(x.float(), layer.weight.float(),
                                              None if layer.bias is None else layer.bias.float()))
        assert all(torch.equal(layer(x[i:i + 1]), every[i:i + 1]) for i in range(12))


def test_bf16_layers_are_widened_to_float32_where_onednn_cannot_pack_bf16():
    layer = Linear(64, 32).to(torch.bfloat16)
    layer.pack(kernels_for(torch.bfloat16))
    expected = OneDnnPackedLinearKernel if onednn_packs_bf16() else WidenedBf16LinearKernel
    assert isinstance(layer.kernel, expected) or quant_cpu_kernels() is None  # no AVX2: the reference serves


@pytest.mark.skipif(not onednn_packs_bf16() and quant_cpu_kernels() is None,
                    reason="bf16 weights keep the reference on a CPU with neither native bf16 nor AVX2")
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_the_reference_for_any_row_count(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(256, 96, bias=bias).to(torch.bfloat16)
    layer.pack(kernels_for(torch.bfloat16))
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        _assert_close_in_bf16(layer(x), want)


@pytest.mark.skipif(not cpu_has(AMX_BF16_FLAGS), reason="the CPU has no AMX")
def test_on_a_cpu_with_amx_the_native_kernels_are_built_for_it():
    assert cpu_kernels().__name__.endswith("_amx")


def test_the_engine_logs_the_cpu_and_the_kernels_it_chose(make_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="gpu_worker.engine.llm_engine"):
        LLM(str(make_checkpoint("llama")), dtype="float32")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels:"))
    assert cpu_model() in line and f"{torch.get_num_threads()} threads" in line
    assert "linear: TorchLinearKernel x" in line and "attention: TorchPagedAttention x" in line


def test_a_zen_4_reads_its_gemv_rows_unaided_and_the_other_cpus_with_a_prefetch_two_rows_ahead():
    assert GemvPlan.for_cpu("AuthenticAMD", 0x19) == GemvPlan(streams=2, prefetch_rows=0)  # Zen 4
    assert GemvPlan.for_cpu("AuthenticAMD", 0x1A) == GemvPlan(streams=2, prefetch_rows=2)  # Zen 5
    assert GemvPlan.for_cpu("GenuineIntel", 6) == GemvPlan(streams=2, prefetch_rows=2)


@pytest.mark.skipif(not onednn_packs_bf16(), reason="bf16 weights are packed for oneDNN only with native bf16")
def test_the_engine_logs_how_its_bf16_gemvs_read_the_weights(make_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="gpu_worker.engine.llm_engine"):
        LLM(str(make_checkpoint("llama")), dtype="bfloat16")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels:"))
    plan = GemvPlan.for_cpu(*cpu_family())
    assert f"bf16 GEMVs: {plan.streams} streams a thread, {plan.prefetch_rows} rows ahead prefetched" in line


def test_float32_layers_keep_the_reference_kernel():
    layer = Linear(64, 32)
    layer.pack(kernels_for(torch.float32))
    assert isinstance(layer.kernel, TorchLinearKernel)


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 4, 64), (8, 8, 32), (16, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])  # AMX scores 32 keys a call: from two blocks, or from one
def test_paged_decode_attention_matches_the_reference(kernels, heads, kv_heads, head_dim, block_size):
    torch.manual_seed(heads)
    num_blocks = 200
    kv_cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, dtype=torch.bfloat16)
    context_lens = [1, 17, 300, 64, 5, 129]
    q = torch.randn(len(context_lens), heads, head_dim, dtype=torch.bfloat16)
    meta = decode_metadata(context_lens, num_blocks, block_size)
    layout = HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5)
    want = TorchPagedAttention(layout).decode(q, kv_cache, meta)
    got = CpuPagedAttention(layout, kernels()).decode(q, kv_cache, meta)
    _assert_close_in_bf16(got, want)


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize("loudest", ["first", "last", "rising"])
def test_paged_decode_attention_is_as_close_to_float32_as_torchs_bf16_wherever_the_largest_scores_lie(kernels,
                                                                                                    loudest):
    # The AMX kernel's softmax runs over the context 32 keys at a time, rescaling what it has summed whenever a later
    # chunk's scores top the earlier ones: keys scaled up at the start, at the end, or more with every token.
    torch.manual_seed(7)
    heads, kv_heads, head_dim, block_size, num_blocks = 12, 4, 64, 16, 64
    kv_cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim)
    context_lens = [300, 97, 33]
    meta = decode_metadata(context_lens, num_blocks, block_size)
    gain = {"first": torch.linspace(4, 1, 300), "last": torch.linspace(1, 4, 300),
            "rising": torch.linspace(0.2, 3, 300)}[loudest]
    for i, length in enumerate(context_lens):
        for t in range(length):
            block, offset = meta.decode_block_tables[i, t // block_size], t % block_size
            kv_cache[0, block, :, offset] *= gain[t]
    kv_cache = kv_cache.to(torch.bfloat16)
    q = torch.randn(len(context_lens), heads, head_dim).to(torch.bfloat16)
    layout = HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5)
    want = TorchPagedAttention(layout).decode(q.float(), kv_cache.float(), meta)
    torch_bf16 = TorchPagedAttention(layout).decode(q, kv_cache, meta)
    got = CpuPagedAttention(layout, kernels()).decode(q, kv_cache, meta)
    assert (got.float() - want).abs().max() <= 1.5 * (torch_bf16.float() - want).abs().max() + 2e-3


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
def test_paged_decode_attention_reads_the_queries_in_place_from_the_fused_projections_rows(kernels):
    # q as the decode step hands it over: a view of qkv's rows, each row's keys and values after its query heads.
    torch.manual_seed(2)
    heads, kv_heads, head_dim, block_size, num_blocks = 12, 4, 64, 16, 200
    kv_cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, dtype=torch.bfloat16)
    context_lens = [1, 17, 300, 64, 5]
    qkv = torch.randn(len(context_lens), (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    meta = decode_metadata(context_lens, num_blocks, block_size)
    attention = CpuPagedAttention(HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5), kernels())
    assert not q.is_contiguous()
    assert torch.equal(attention.decode(q, kv_cache, meta), attention.decode(q.contiguous(), kv_cache, meta))


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (16, 2, 128)])
def test_a_decode_step_in_one_native_call_rotates_writes_and_attends_as_the_reference(kernels, heads, kv_heads,
                                                                                      head_dim):
    from gpu_worker.engine.rope import RotaryEmbedding

    torch.manual_seed(heads)
    block_size, num_blocks, context_lens = 16, 200, [1, 17, 300, 64]
    meta = decode_metadata(context_lens, num_blocks, block_size)
    layout = HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5)
    qkv = torch.randn(len(context_lens), (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, {}).cos_sin(meta.decode_context_lens - 1, torch.bfloat16)
    before = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, dtype=torch.bfloat16)
    want_cache, got_cache = before.clone(), before.clone()
    want = TorchPagedAttention(layout)(qkv.clone(), cos, sin, want_cache, meta)
    got = CpuPagedAttention(layout, kernels())(qkv.clone(), cos, sin, got_cache, meta)
    assert got.shape == (len(context_lens), heads * head_dim)
    _assert_close_in_bf16(got, want)
    assert torch.equal(got_cache, want_cache) and not torch.equal(got_cache, before)


needs_native_prefill = pytest.mark.skipif(
    cpu_kernels() is None or not NativePrefillAttention.takes(cpu_kernels(), 64),
    reason="the prefill kernels need AVX512-BF16 (and, on a CPU with AMX, Linux's leave to use its tiles)")


@needs_native_prefill
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 4, 64), (8, 8, 32), (6, 2, 96), (16, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 128])
def test_native_prefill_attention_matches_the_float32_reference_as_closely_as_torchs_bf16(heads, kv_heads, head_dim,
                                                                                          block_size):
    torch.manual_seed(heads + head_dim)
    cache = torch.randn(2, 1280 // block_size, kv_heads, block_size, head_dim, dtype=torch.bfloat16)
    # Chunks alone and after cached context, partial 16-row tiles, a one-token chunk; decode rows before them.
    chunks = [(37, 37), (16, 300), (1, 17), (100, 100), (5, 133)]
    q, k, v, meta = mixed_step([5, 40], chunks, cache, heads)
    layout = HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5)
    want = TorchPagedAttention(layout).attend(q.float(), k.float(), v.float(), cache.float(), meta)
    torch_bf16 = TorchPagedAttention(layout).attend(q, k, v, cache, meta)
    got = NativePrefillAttention(layout, cpu_kernels()).attend(q, k, v, cache, meta)
    _assert_close_in_bf16(got, want)
    assert (got.float() - want).abs().max() <= 1.5 * (torch_bf16.float() - want).abs().max() + 2e-3


@needs_native_prefill
@pytest.mark.skipif(cpu_has(AMX_BF16_FLAGS), reason="the AMX kernel takes one softmax over the whole context")
def test_avx512_prefill_attention_rounds_as_torchs_flash_attention_does():
    # Its softmax is torch's (max and bf16 probabilities per 512-key block, over contexts past 512 too), so its
    # outputs are torch's bf16 outputs but for the order of fp32 sums: the same bits in 83-96 % of them here, where
    # torch's float32 attention rounded to bf16 agrees with its bf16 one on 62-68 %.
    torch.manual_seed(3)
    block_size, heads, kv_heads, head_dim = 16, 12, 4, 64
    cache = torch.randn(2, 1600 // block_size, kv_heads, block_size, head_dim, dtype=torch.bfloat16)
    q, k, v, meta = mixed_step([5], [(300, 300), (64, 1100), (40, 40)], cache, heads)
    layout = HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5)
    torch_bf16 = TorchPagedAttention(layout).attend(q, k, v, cache, meta)
    got = NativePrefillAttention(layout, cpu_kernels()).attend(q, k, v, cache, meta)
    assert (got == torch_bf16).float().mean() >= 0.8
    assert (got.float() - torch_bf16.float()).abs().max() <= 2 ** -7 * torch_bf16.float().abs().max()


@needs_native_prefill
def test_on_a_cpu_with_avx512_bf16_serving_takes_the_native_prefill():
    assert type(kernels_for(torch.bfloat16).attention(HeadLayout(12, 4, 64, 0.125))) is NativePrefillAttention


@needs_avx512_bf16
def test_native_kv_write_fills_the_same_slots_as_the_reference_from_a_fused_qkv_slice():
    torch.manual_seed(5)
    kv_heads, head_dim, block_size, num_blocks, tokens = 4, 64, 16, 20, 37
    qkv = torch.randn(tokens, (12 + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    _, k, v = qkv.split([12 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    meta = AttentionMetadata(slots // block_size, slots % block_size, block_size, [], None, None, [])
    caches = [torch.zeros(2, num_blocks, kv_heads, block_size, head_dim, dtype=torch.bfloat16) for _ in range(2)]
    layout = HeadLayout(12, kv_heads, head_dim, 1.0)
    TorchPagedAttention(layout).write_kv(k, v, caches[0], meta)
    CpuPagedAttention(layout, cpu_kernels()).write_kv(k, v, caches[1], meta)
    assert torch.equal(caches[0], caches[1]) and caches[0].count_nonzero() == 2 * k.numel()


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_native_rms_norm_add_rms_norm_and_silu_and_mul_match_their_references(kernels, rows):
    from gpu_worker.engine import ops

    torch.manual_seed(rows)
    x = torch.randn(rows, 256, dtype=torch.bfloat16) * 3
    weight = torch.randn(256, dtype=torch.bfloat16)
    _assert_close_in_bf16(kernels().rms_norm_bf16(x, weight, 1e-5), ops.rms_norm_reference(x, weight, 1e-5))
    _assert_close_in_bf16(kernels().silu_and_mul_bf16(x), ops.silu_and_mul_reference(x))
    residual = torch.randn_like(x)
    for got, want in zip(kernels().add_rms_norm_bf16(x, residual, weight, 1e-5),
                         ops.add_rms_norm_reference(x, residual, weight, 1e-5), strict=True):
        _assert_close_in_bf16(got, want)


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
def test_native_silu_and_mul_holds_at_magnitudes_where_its_exp_leaves_float32s_range(kernels):
    from gpu_worker.engine import ops

    gate = torch.tensor([-1e4, -1000, -100, -88.5, -60, -1, 0, 1, 60, 88.5, 100, 1000, 1e4, -3e38, 3e38, 2])
    x = torch.cat([gate.repeat(2), torch.full((32,), 0.5)]).to(torch.bfloat16)[None]
    got, want = kernels().silu_and_mul_bf16(x), ops.silu_and_mul_reference(x)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
def test_native_argmax_takes_the_first_maximum_like_torch(kernels):
    torch.manual_seed(3)
    logits = torch.randn(13, 1001, dtype=torch.float32).to(torch.bfloat16)
    logits[0, 5] = logits[0, 700] = 99.0  # a tie: the first index wins
    logits[1, -1] = 99.0  # a maximum in the tail past the last full vector
    logits[2, 37] = logits[2, 18] = 99.0  # tied in different vector lanes, the later lane first
    logits[3, 21] = logits[3, 5] = 99.0  # tied in one lane
    logits[4, 900] = logits[4, 1000] = 99.0  # tied between the vectors and the tail
    logits[5] = -float("inf")  # nothing but -inf: index 0
    logits[6, 300], logits[6, 40] = float("nan"), 99.0  # a NaN counts as the maximum
    logits[7, :] = 1.0  # every value tied
    logits[8] = (logits[8] * 4).round() / 4  # bf16 logits tie often: coarse values
    got = kernels().argmax_bf16(logits)
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[:8].tolist() == [5, 1000, 18, 5, 900, 0, 300, 0]
    assert kernels().argmax_bf16(logits[:, :7].contiguous()).tolist() == logits[:, :7].argmax(dim=-1).tolist()


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
def test_native_rotary_matches_the_reference_in_place(kernels):
    from gpu_worker.engine import ops
    from gpu_worker.engine.rope import RotaryEmbedding

    torch.manual_seed(4)
    heads, head_dim, width = 5, 64, 5 * 64 + 2 * 64  # 5 rotated heads, then 2 that stay (v)
    qkv = torch.randn(37, width, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, {}).cos_sin(torch.arange(37) * 7, torch.bfloat16)
    want = qkv.clone()
    ops.rotary_reference_(want, cos, sin, heads, head_dim)
    got = qkv.clone()
    kernels().rotary_inplace_bf16(got, cos, sin, heads, head_dim)
    assert torch.equal(got[:, heads * head_dim:], qkv[:, heads * head_dim:])
    assert (got != want).float().mean() < 1e-3  # the same rounding steps: equal but for rare ties
    _assert_close_in_bf16(got, want)


needs_avx2 = pytest.mark.skipif(not cpu_has(AVX2_FLAGS), reason="the CPU has no AVX2")


@needs_avx2
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 4), (9, 3), (16, 4), (20, 4), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 128])
def test_avx2_decode_attention_is_the_float32_reference_rounded_to_bf16(heads, kv_heads, block_size):
    torch.manual_seed(heads)
    num_blocks = 60
    kv_cache = torch.randn(2, num_blocks, kv_heads, block_size, 64, dtype=torch.bfloat16)
    context_lens = [1, 7, 8, 9, 130, 300]
    q = torch.randn(len(context_lens), heads, 64, dtype=torch.bfloat16)
    meta = decode_metadata(context_lens, num_blocks, block_size)
    layout = HeadLayout(heads, kv_heads, 64, 0.125)
    want = TorchPagedAttention(layout).decode(q.float(), kv_cache.float(), meta)
    got = CpuPagedAttention(layout, avx2_kernels()).decode(q, kv_cache, meta)
    # float32 sums in another order: the same bf16 but where the float32 result lies next to a rounding boundary
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()
    assert (got != want.bfloat16()).float().mean() < 0.01


@needs_avx2
def test_a_cpu_without_avx512_bf16_runs_its_element_wise_ops_and_decode_attention_on_the_avx2_kernels():
    layout = HeadLayout(12, 4, 64, 0.125)
    kernels = kernels_for(torch.bfloat16, cpu_isa="avx2")
    assert kernels.ops.module is avx2_kernels()
    assert kernels_for(torch.float32, cpu_isa="avx2").ops.module is None  # float32 keeps the torch path
    attention = kernels.attention(layout)
    assert type(attention) is CpuPagedAttention and attention.kernels is avx2_kernels()
    attention = kernels_for(torch.bfloat16, cpu_isa="avx2", kv_cache_dtype="int8").attention(layout)
    assert type(attention) is CpuInt8PagedAttention and attention.kernels is avx2_kernels()


def test_widened_decode_attention_is_the_float32_reference_rounded_to_bf16():
    torch.manual_seed(0)
    kv_cache = torch.randn(2, 40, 4, 16, 64, dtype=torch.bfloat16)
    q = torch.randn(3, 12, 64, dtype=torch.bfloat16)
    meta = decode_metadata([1, 90, 300], 40, 16)
    layout = HeadLayout(12, 4, 64, 0.125)
    want = TorchPagedAttention(layout).decode(q.float(), kv_cache.float(), meta).bfloat16()
    assert torch.equal(WidenedDecodeAttention(layout).decode(q, kv_cache, meta), want)


def test_bf16_on_cpu_decodes_in_float32_where_the_native_attention_does_not_apply():
    layout = HeadLayout(4, 2, 48, 48**-0.5)  # a head size the native kernels do not take, on any CPU
    assert type(kernels_for(torch.bfloat16).attention(layout)) is WidenedDecodeAttention
    assert type(kernels_for(torch.float32).attention(layout)) is TorchPagedAttention  # the exactness reference
