"""Sliding-window attention (`HeadLayout.window`) in every paged-attention kernel against the reference
(`TorchPagedAttention` / `ScaledPagedAttention` with the same layout): decode rows and prefill chunks over a cached
context, windows shorter than the contexts, off the block size, of one token, and longer than some contexts. The
block-table entries of blocks wholly before a row's window are freed (-1) as the KV manager frees them, over a cache
with NaN where a read of one would land (`kernel_inputs.poisoned`): a kernel that reads them fails. Each case has a
row whose window is shorter than its context, and checks that full attention would not pass for the windowed one:
a kernel that ignored the window fails. Triton's kernels run on CUDA when there is one, else in its interpreter
(fp32 and fp16)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before a Triton kernel is defined

from gpu_worker.engine.attention import (  # noqa: E402
    AttentionMetadata,
    HeadLayout,
    ScaledPagedAttention,
    TorchPagedAttention,
)
from gpu_worker.engine.cpu_attention import (  # noqa: E402
    CpuInt8PagedAttention,
    CpuPagedAttention,
    NativePrefillAttention,
    WidenedDecodeAttention,
)
from gpu_worker.engine.kernels import AMX_BF16_FLAGS, cpu_has, cpu_kernels  # noqa: E402
from gpu_worker.engine.kv_cache_format import ScaledKVCache  # noqa: E402
from tests.kernel_inputs import (  # noqa: E402
    NATIVE_BUILDS,
    decode_metadata,
    free_out_of_window,
    mixed_step,
    poisoned,
    poisoned_int8,
)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
needs_native_prefill = pytest.mark.skipif(
    cpu_kernels() is None or not NativePrefillAttention.takes(cpu_kernels(), 64),
    reason="the prefill kernels need AVX512-BF16 (and, on a CPU with AMX, Linux's leave to use its tiles)")

WINDOWS = [1, 5, 16, 37, 100, 1000]  # one token, off and on the block size, longer than most contexts
# One token, block boundaries, long; with a row `window + 40` long added to each case (its first block freed).
CONTEXTS = [1, 17, 300, 64, 5, 129, 40]


def layouts(heads: int, kv_heads: int, head_dim: int, window: int) -> tuple[HeadLayout, HeadLayout]:
    """The windowed layout, and the same without a window."""
    return HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5, window), HeadLayout(heads, kv_heads, head_dim,
                                                                                       head_dim**-0.5)


def close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    # bf16 keeps 8 bits of mantissa: outputs may differ from an fp32 reference by its rounding, no more.
    got, want = got.float(), want.float()
    return bool(((got - want).abs() <= 1e-2 * want.abs() + 1e-2 * want.abs().max()).all())


def assert_windowed(got: torch.Tensor, want: torch.Tensor, full: torch.Tensor, close=close_in_bf16) -> None:
    """`got` is the windowed reference `want`, and full attention (`full`) is not: ignoring the window fails."""
    assert close(got, want), f"max error {(got.float() - want.float()).abs().max().item():.3g}"
    assert not close(full, want), "the window changes nothing here: the case tests nothing"


def decode_case(contexts: list[int], window: int, block_size: int, kv_heads: int, head_dim: int, freed: bool,
                dtype=torch.bfloat16) -> tuple[torch.Tensor, AttentionMetadata, AttentionMetadata]:
    """A random cache (poisoned past its blocks) and decode rows over it: (cache, the rows' metadata with the
    out-of-window entries freed where `freed`, the same unfreed for full attention)."""
    num_blocks = sum(-(-c // block_size) for c in contexts) + 2
    cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim).to(dtype)
    full = decode_metadata(contexts, num_blocks, block_size)
    meta = decode_metadata(contexts, num_blocks, block_size)
    if freed:
        free_out_of_window(meta, window)
        assert (meta.decode_block_tables == -1).any()
    return poisoned(cache), meta, full


# --- The native CPU kernels: decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(12, 4, 64, 16), (16, 2, 128, 32)])
@pytest.mark.parametrize("freed", [False, True])
def test_native_bf16_decode_attends_over_the_window_only(kernels, window, heads, kv_heads, head_dim, block_size,
                                                          freed):
    torch.manual_seed(window + heads)
    contexts = [*CONTEXTS, window + 40]
    cache, meta, full_meta = decode_case(contexts, window, block_size, kv_heads, head_dim, freed)
    windowed, full = layouts(heads, kv_heads, head_dim, window)
    q = torch.randn(len(contexts), heads, head_dim, dtype=torch.bfloat16)
    want = TorchPagedAttention(windowed).decode(q.float(), cache.float(), meta)
    got = CpuPagedAttention(windowed, kernels()).decode(q, cache, meta)
    assert_windowed(got, want, TorchPagedAttention(full).decode(q.float(), cache.float(), full_meta))


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize("window", [1, 5, 37, 1000])
def test_a_native_bf16_decode_step_in_one_call_attends_over_the_window_only(kernels, window):
    from gpu_worker.engine.rope import RotaryEmbedding

    torch.manual_seed(window)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    contexts = [*CONTEXTS, window + 40]
    cache, meta, full_meta = decode_case(contexts, window, block_size, kv_heads, head_dim, freed=True)
    windowed, full = layouts(heads, kv_heads, head_dim, window)
    qkv = torch.randn(len(contexts), (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, {}).cos_sin(meta.decode_context_lens - 1, torch.bfloat16)
    want_cache, got_cache = cache.clone(), poisoned(cache[:, :-1])
    want = TorchPagedAttention(windowed)(qkv.clone(), cos, sin, want_cache, meta)
    got = CpuPagedAttention(windowed, kernels())(qkv.clone(), cos, sin, got_cache, meta)
    without = TorchPagedAttention(full)(qkv.clone(), cos, sin, cache.clone(), full_meta)
    assert_windowed(got, want, without)
    assert torch.equal(got_cache[:, :-1], want_cache[:, :-1])


@pytest.mark.parametrize("window", [1, 16, 37, 1000])
def test_widened_decode_attention_over_a_window_is_the_float32_reference_rounded_to_bf16(window):
    torch.manual_seed(window)
    contexts = [*CONTEXTS, window + 40]
    cache, meta, _ = decode_case(contexts, window, 16, 4, 64, freed=True)
    windowed, _ = layouts(12, 4, 64, window)
    q = torch.randn(len(contexts), 12, 64, dtype=torch.bfloat16)
    want = TorchPagedAttention(windowed).decode(q.float(), cache.float(), meta).bfloat16()
    assert torch.equal(WidenedDecodeAttention(windowed).decode(q, cache, meta), want)


def int8_case(contexts: list[int], window: int, block_size: int, kv_heads: int, head_dim: int, freed: bool):
    """`decode_case` over an int8 cache: (its data and scales poisoned, the metadata freed or not, unfreed)."""
    num_blocks = sum(-(-c // block_size) for c in contexts) + 2
    data = torch.randint(-127, 128, (2, num_blocks, kv_heads, block_size, head_dim), dtype=torch.int8)
    scale = (torch.rand(2, num_blocks, kv_heads, block_size) * 0.05 + 1e-3).bfloat16()
    full = decode_metadata(contexts, num_blocks, block_size)
    meta = decode_metadata(contexts, num_blocks, block_size)
    if freed:
        free_out_of_window(meta, window)
    return ScaledKVCache(*poisoned_int8(data, scale)), meta, full


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("freed", [False, True])
def test_native_int8_decode_attends_over_the_window_only(kernels, window, freed):
    torch.manual_seed(window)
    heads, kv_heads, head_dim = 12, 4, 64
    contexts = [*CONTEXTS, window + 40]
    cache, meta, full_meta = int8_case(contexts, window, 16, kv_heads, head_dim, freed)
    windowed, full = layouts(heads, kv_heads, head_dim, window)
    q = torch.randn(len(contexts), heads, head_dim, dtype=torch.bfloat16)
    as_float = ScaledKVCache(cache.data, cache.scale.float())
    want = ScaledPagedAttention(windowed).decode(q.float(), as_float, meta)
    got = CpuInt8PagedAttention(windowed, kernels()).decode(q, cache, meta)
    assert_windowed(got, want, ScaledPagedAttention(full).decode(q.float(), as_float, full_meta))


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize("window", [1, 37, 1000])
def test_a_native_int8_decode_step_in_one_call_attends_over_the_window_only(kernels, window):
    from gpu_worker.engine.rope import RotaryEmbedding

    torch.manual_seed(window)
    heads, kv_heads, head_dim = 9, 3, 64
    contexts = [*CONTEXTS, window + 40]
    cache, meta, full_meta = int8_case(contexts, window, 16, kv_heads, head_dim, freed=True)
    windowed, full = layouts(heads, kv_heads, head_dim, window)
    qkv = torch.randn(len(contexts), (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, {}).cos_sin(meta.decode_context_lens - 1, torch.bfloat16)

    def copy():
        return ScaledKVCache(*poisoned_int8(cache.data[:, :-1], cache.scale[:, :-1]))

    want_cache, got_cache = copy(), copy()
    want = ScaledPagedAttention(windowed)(qkv.clone(), cos, sin, want_cache, meta)
    got = CpuInt8PagedAttention(windowed, kernels())(qkv.clone(), cos, sin, got_cache, meta)
    without = ScaledPagedAttention(full)(qkv.clone(), cos, sin, copy(), full_meta)
    assert_windowed(got, want, without)
    assert torch.equal(got_cache.data, want_cache.data)
    assert torch.equal(got_cache.scale[:, :-1], want_cache.scale[:, :-1])  # the last block NaN (never written)


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
def test_native_int8_gather_reads_no_freed_entry(kernels):
    torch.manual_seed(3)
    kv_heads, head_dim, block_size, num_blocks, length = 3, 64, 16, 40, 150
    data = torch.randint(-127, 128, (2, num_blocks, kv_heads, block_size, head_dim), dtype=torch.int8)
    scale = (torch.rand(2, num_blocks, kv_heads, block_size) * 0.05 + 1e-3).bfloat16()
    cache = ScaledKVCache(*poisoned_int8(data, scale))
    tables = torch.stack([torch.randperm(num_blocks)[:10] for _ in range(3)])
    tables[0, :4] = -1
    tables[2, :9] = -1
    layout = HeadLayout(kv_heads, kv_heads, head_dim, 1.0)
    want = ScaledPagedAttention(layout).gather(cache, tables, length)
    got = CpuInt8PagedAttention(layout, kernels()).gather(cache, tables, length)
    freed = (tables == -1).repeat_interleave(block_size, 1)[:, None, :length, None].expand_as(got[0])
    for w, g in zip(want, got, strict=True):
        assert torch.equal(g[~freed], w[~freed])  # what the reference gathers, where it gathers the sequence's own
        assert not g[freed].any()  # zeros in a freed block's place


# --- The native CPU kernels: prefill over a cached context ------------------------------------------------------


def prefill_case(window: int, block_size: int, kv_heads: int, head_dim: int, heads: int, chunks=None):
    """A step of decode rows and prefill chunks (fresh prompts longer and shorter than the window, chunks after a
    cached context, one row) over a poisoned bf16 cache: (q, k, v, cache, meta with the out-of-window entries freed,
    the same unfreed)."""
    chunks = chunks or [(37, 37), (16, 300), (1, 17), (100, 100), (5, 133), (40, window + 60)]
    decodes = [5, 40, window + 40]
    num_blocks = sum(-(-c // block_size) for c in decodes + [c for _, c in chunks]) + 2
    cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, dtype=torch.bfloat16)
    q, k, v, full = mixed_step(decodes, chunks, cache, heads)
    meta = dataclasses.replace(full, decode_block_tables=full.decode_block_tables.clone(),
                               prefills=[dataclasses.replace(c, block_table=c.block_table.clone())
                                         for c in full.prefills])
    free_out_of_window(meta, window)
    return q, k, v, poisoned(cache), meta, full


@needs_native_prefill
@pytest.mark.parametrize("window", [1, 5, 16, 37, 100, 1000])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(12, 4, 64, 16), (8, 8, 32, 16), (16, 2, 128, 128)])
def test_native_prefill_attends_over_the_window_only(window, heads, kv_heads, head_dim, block_size):
    torch.manual_seed(window + head_dim)
    q, k, v, cache, meta, full_meta = prefill_case(window, block_size, kv_heads, head_dim, heads)
    windowed, full = layouts(heads, kv_heads, head_dim, window)
    want = TorchPagedAttention(windowed).attend(q.float(), k.float(), v.float(), cache.float(), meta)
    torch_bf16 = TorchPagedAttention(windowed).attend(q, k, v, cache, meta)
    got = NativePrefillAttention(windowed, cpu_kernels()).attend(q, k, v, cache, meta)
    without = TorchPagedAttention(full).attend(q.float(), k.float(), v.float(), cache.float(), full_meta)
    assert_windowed(got, want, without)
    assert (got.float() - want).abs().max() <= 1.5 * (torch_bf16.float() - want).abs().max() + 2e-3
    rows = slice(meta.num_decodes, None)  # the prefill rows alone: the window matters there too
    assert_windowed(got[rows], want[rows], without[rows])


@needs_native_prefill
@pytest.mark.skipif(cpu_has(AMX_BF16_FLAGS), reason="the AMX kernel takes one softmax over the whole context")
@pytest.mark.parametrize("window", [700, 333])
def test_avx512_windowed_prefill_rounds_as_torchs_flash_attention_does(window):
    # Key blocks of 512 from the first block the chunk's first row sees, as the reference gathers them: tasks whose
    # window starts past the first block skip it, and their outputs stay torch's bf16 ones but for the order of sums.
    torch.manual_seed(window)
    heads, kv_heads, head_dim = 12, 4, 64
    q, k, v, cache, meta, _ = prefill_case(window, 16, kv_heads, head_dim, heads,
                                           chunks=[(300, 1400), (64, 1100), (40, 40)])
    windowed, _ = layouts(heads, kv_heads, head_dim, window)
    torch_bf16 = TorchPagedAttention(windowed).attend(q, k, v, cache, meta)
    got = NativePrefillAttention(windowed, cpu_kernels()).attend(q, k, v, cache, meta)
    assert (got == torch_bf16).float().mean() >= 0.8
    assert (got.float() - torch_bf16.float()).abs().max() <= 2 ** -7 * torch_bf16.float().abs().max()


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize("window", [1, 5, 37, 1000])
def test_native_int8_prefill_over_a_cached_context_attends_over_the_window_only(kernels, window):
    torch.manual_seed(window)
    heads, kv_heads, head_dim, block_size = 12, 4, 64, 16
    chunks = [(37, 37), (16, 300), (1, 17), (5, 133), (40, window + 60)]
    decodes = [5, window + 40]
    num_blocks = sum(-(-c // block_size) for c in decodes + [c for _, c in chunks]) + 2
    data = torch.randint(-127, 128, (2, num_blocks, kv_heads, block_size, head_dim), dtype=torch.int8)
    scale = (torch.rand(2, num_blocks, kv_heads, block_size) * 0.05 + 1e-3).bfloat16()
    dense = data.float() * scale.float()[..., None]  # what the cache holds, for the step's own keys and values
    q, k, v, meta = mixed_step(decodes, chunks, dense, heads)
    full_meta = dataclasses.replace(meta, decode_block_tables=meta.decode_block_tables.clone(),
                                    prefills=[dataclasses.replace(c, block_table=c.block_table.clone())
                                              for c in meta.prefills])
    free_out_of_window(meta, window)
    cache = ScaledKVCache(*poisoned_int8(data, scale))
    as_float = ScaledKVCache(cache.data, cache.scale.float())
    windowed, full = layouts(heads, kv_heads, head_dim, window)
    want = ScaledPagedAttention(windowed).attend(q, k, v, as_float, meta)
    got = CpuInt8PagedAttention(windowed, kernels()).attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache, meta)
    without = ScaledPagedAttention(full).attend(q, k, v, as_float, full_meta)
    assert_windowed(got, want, without)


# --- Triton ------------------------------------------------------------------------------------------------------

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_DTYPES = [torch.float32, torch.float16]  # the interpreter is wrong in bf16


def triton_close(dtype: torch.dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-3

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        got, want = got.float().cpu(), want.float().cpu()
        return bool(((got - want).abs() <= tol * (1 + want.abs())).all())

    return close


def on_device(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata's tensors where the Triton kernels run."""
    return dataclasses.replace(
        meta, slot_blocks=meta.slot_blocks.to(DEVICE), slot_offsets=meta.slot_offsets.to(DEVICE),
        decode_block_tables=None if meta.decode_block_tables is None else meta.decode_block_tables.to(DEVICE),
        decode_context_lens=None if meta.decode_context_lens is None else meta.decode_context_lens.to(DEVICE),
        prefills=[dataclasses.replace(c, block_table=c.block_table.to(DEVICE)) for c in meta.prefills])


def device_poisoned(cache: torch.Tensor) -> torch.Tensor:
    """`poisoned(cache)` on DEVICE, its NaN margins included (a copy of a view would leave them behind)."""
    return poisoned(cache[:, :-1].to(DEVICE)) if DEVICE.type == "cuda" else cache


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("window", [1, 5, 37, 100, 1000])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 80)])
def test_triton_decode_attends_over_the_window_only(dtype, window, heads, kv_heads, head_dim):
    from gpu_worker.engine.kernels.triton_paged_attention import paged_decode

    torch.manual_seed(window + heads)
    contexts = [*CONTEXTS, window + 40]
    cache, meta, full_meta = decode_case(contexts, window, 16, kv_heads, head_dim, freed=True, dtype=dtype)
    windowed, full = layouts(heads, kv_heads, head_dim, window)
    q = torch.randn(len(contexts), heads, head_dim).to(dtype)
    want = TorchPagedAttention(windowed).decode(q.float(), cache.float(), meta)
    on = device_poisoned(cache)
    got = paged_decode(q.to(DEVICE), on[0], on[1], meta.decode_block_tables.to(DEVICE),
                       meta.decode_context_lens.to(DEVICE), windowed.scale, window=window)
    assert_windowed(got, want, TorchPagedAttention(full).decode(q.float(), cache.float(), full_meta),
                    triton_close(dtype))


@needs_triton
@pytest.mark.parametrize("split_tokens", [64, 256])
@pytest.mark.parametrize("window", [100, 300, 1000])
def test_triton_decode_split_over_a_long_context_reads_the_windows_splits_only(split_tokens, window):
    # Windows starting mid-split, spanning several splits and one: the splits before a row's window write nothing,
    # and `_combine_splits` merges only those from the window's first.
    from gpu_worker.engine.kernels.triton_paged_attention import paged_decode

    torch.manual_seed(window + split_tokens)
    contexts = [4100, 1, 700, window + 40]
    cache, meta, full_meta = decode_case(contexts, window, 16, 2, 64, freed=True, dtype=torch.float16)
    windowed, full = layouts(8, 2, 64, window)
    q = torch.randn(len(contexts), 8, 64).to(torch.float16)
    want = TorchPagedAttention(windowed).decode(q.float(), cache.float(), meta)
    on = device_poisoned(cache)
    got = paged_decode(q.to(DEVICE), on[0], on[1], meta.decode_block_tables.to(DEVICE),
                       meta.decode_context_lens.to(DEVICE), windowed.scale, split_tokens=split_tokens, window=window)
    assert_windowed(got, want, TorchPagedAttention(full).decode(q.float(), cache.float(), full_meta),
                    triton_close(torch.float16))


@needs_triton
@pytest.mark.parametrize("contexts", [[1100, 1, 190, 256], [1, 190, 256]])  # split; all within one split
def test_triton_windowed_decode_is_the_same_to_the_bit_over_wider_tables(contexts):
    """A CUDA graph's step (tables as wide as the longest context served) sums as an eager one, windowed too."""
    from gpu_worker.engine.kernels.triton_paged_attention import paged_decode

    torch.manual_seed(7)
    cache, meta, _ = decode_case(contexts, 100, 16, 2, 64, freed=True, dtype=torch.float32)
    q = torch.randn(len(contexts), 8, 64).to(DEVICE)
    on = device_poisoned(cache)
    tables, lens = meta.decode_block_tables.to(DEVICE), meta.decode_context_lens.to(DEVICE)
    wide = torch.cat([tables, torch.zeros(len(contexts), 64, dtype=tables.dtype, device=DEVICE)], 1)
    eager = paged_decode(q, on[0], on[1], tables, lens, 0.125, window=100)
    assert torch.equal(paged_decode(q, on[0], on[1], wide, lens, 0.125, window=100), eager)
    assert not eager.isnan().any()


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("window", [1, 5, 37, 100, 1000])
def test_triton_prefill_over_a_cached_context_attends_over_the_window_only(dtype, window):
    # Through `triton_attend`, what TritonPagedAttention runs: the step's decode rows and prefill chunks.
    from gpu_worker.engine.triton_attention import triton_attend

    torch.manual_seed(window)
    heads, kv_heads, head_dim = 4, 2, 64
    # A chunk longer than a query tile, so that its later tiles start at their own first row's window.
    chunks = [(37, 37), (16, 300), (1, 17), (70, 70), (5, 133), (40, window + 60)]
    q, k, v, cache, meta, full_meta = prefill_case(window, 16, kv_heads, head_dim, heads, chunks)
    q, k, v, cache = q.to(dtype), k.to(dtype), v.to(dtype), poisoned(cache[:, :-1].to(dtype))
    windowed, full = layouts(heads, kv_heads, head_dim, window)
    want = TorchPagedAttention(windowed).attend(q.float(), k.float(), v.float(), cache.float(), meta)
    without = TorchPagedAttention(full).attend(q.float(), k.float(), v.float(), cache.float(), full_meta)
    on = device_poisoned(cache)
    got = triton_attend(q.to(DEVICE), (on[0], on[1], None, None), on_device(meta), windowed.scale, window)
    assert_windowed(got, want, without, triton_close(dtype))
    rows = slice(meta.num_decodes, None)
    assert_windowed(got[rows], want[rows], without[rows], triton_close(dtype))


@needs_triton
@pytest.mark.parametrize("window", [1, 37, 1000])
def test_triton_attention_over_an_int8_cache_attends_over_the_window_only(window):
    from gpu_worker.engine.triton_attention import TritonScaledPagedAttention

    torch.manual_seed(window)
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    chunks = [(17, 40), (9, 9), (1, 17), (40, window + 60)]
    decodes = [5, 129, window + 40]
    num_blocks = sum(-(-c // block_size) for c in decodes + [c for _, c in chunks]) + 2
    data = torch.randint(-127, 128, (2, num_blocks, kv_heads, block_size, head_dim), dtype=torch.int8)
    scale = torch.rand(2, num_blocks, kv_heads, block_size) * 0.05 + 1e-3
    q, k, v, meta = mixed_step(decodes, chunks, data.float() * scale[..., None], heads)
    full_meta = dataclasses.replace(meta, decode_block_tables=meta.decode_block_tables.clone(),
                                    prefills=[dataclasses.replace(c, block_table=c.block_table.clone())
                                              for c in meta.prefills])
    free_out_of_window(meta, window)
    windowed, full = layouts(heads, kv_heads, head_dim, window)
    want = ScaledPagedAttention(windowed).attend(q, k, v, ScaledKVCache(data, scale), meta)
    without = ScaledPagedAttention(full).attend(q, k, v, ScaledKVCache(data, scale), full_meta)
    poisoned_data, poisoned_scale = poisoned_int8(data, scale)
    if DEVICE.type == "cuda":
        poisoned_data, poisoned_scale = poisoned_int8(data.to(DEVICE), scale.to(DEVICE))
    got = TritonScaledPagedAttention(windowed).attend(q.to(DEVICE), None, None,
                                                      ScaledKVCache(poisoned_data, poisoned_scale), on_device(meta))
    assert_windowed(got, want, without, triton_close(torch.float32))
