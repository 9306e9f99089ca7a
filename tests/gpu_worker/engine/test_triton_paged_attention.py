"""Triton paged attention (gpu_worker/engine/kernels/triton_paged_attention.py) against the gathering references:
decode (split or not) over a dense, an int8 and an FP8 cache, and chunked prefill over the paged context, with
and without attention sinks. On CUDA when there is one, else in Triton's interpreter on CPU (fp32 and fp16; it is
wrong in bf16)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is defined
pytest.importorskip("triton", reason="Triton is not installed")

from gpu_worker.engine.attention import (  # noqa: E402
    HeadLayout,
    ScaledPagedAttention,
    TorchPagedAttention,
    _gather,
    softmax_with_sinks,
)
from gpu_worker.engine.kernels.triton_paged_attention import paged_decode, paged_prefill  # noqa: E402
from gpu_worker.engine.kv_cache_format import ScaledKVCache  # noqa: E402
from gpu_worker.engine.triton_attention import TritonScaledPagedAttention  # noqa: E402
from tests.kernel_inputs import decode_metadata  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16]
# (heads, KV heads, head_dim): GQA 1, 3 (a padded group), 4 and 8; head dims 64 and 128, and 80 (padded). Few
# heads each: the interpreter runs a program at a time.
SHAPES = [(8, 8, 64), (12, 4, 64), (16, 4, 128), (8, 1, 128), (4, 2, 80)]
CONTEXTS = [1, 17, 300, 64, 5, 129, 16, 32]  # one token, block boundaries, long
BLOCK_SIZE = 16


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype
    assert ((got.float().cpu() - want.float().cpu()).abs() <= tol * (1 + want.float().cpu().abs())).all()


def _dense_decode(heads, kv_heads, head_dim, dtype, contexts, sinks=None, **kwargs):
    """(Triton's, the reference's) decode attention over a random dense cache; `sinks`: the heads' sink logits."""
    torch.manual_seed(heads * 131 + len(contexts))
    num_blocks = sum(-(-c // BLOCK_SIZE) for c in contexts) + 3
    cache = torch.randn(2, num_blocks, kv_heads, BLOCK_SIZE, head_dim).to(dtype)
    q = torch.randn(len(contexts), heads, head_dim).to(dtype)
    meta = decode_metadata(contexts, num_blocks, BLOCK_SIZE)
    scale = head_dim**-0.5
    reference = TorchPagedAttention(HeadLayout(heads, kv_heads, head_dim, scale, sinks=sinks is not None))
    reference.sinks = sinks
    want = reference.decode(q.float(), cache.float(), meta)
    got = paged_decode(q.to(DEVICE), cache[0].to(DEVICE), cache[1].to(DEVICE), meta.decode_block_tables.to(DEVICE),
                       meta.decode_context_lens.to(DEVICE), scale,
                       sinks=None if sinks is None else sinks.to(DEVICE), **kwargs)
    return got, want


def _loud_sinks(heads: int) -> torch.Tensor:
    """Sink logits of a few units, as trained gpt-oss heads have: they take a share of each softmax worth checking."""
    return torch.linspace(-1.0, 4.0, heads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_triton_decode_over_a_dense_cache_matches_the_reference(heads, kv_heads, head_dim, dtype):
    _assert_close(*_dense_decode(heads, kv_heads, head_dim, dtype, CONTEXTS), dtype)


@pytest.mark.parametrize("split_tokens", [64, 256, 704])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_split_over_a_long_context_matches_the_reference(split_tokens, dtype):
    # Splits past the shorter rows' contexts are empty: their partials must not count; 4100 tokens in splits of
    # 64 are merged over several groups of splits.
    _assert_close(*_dense_decode(8, 2, 64, dtype, [4100, 1, 700], split_tokens=split_tokens), dtype)


@pytest.mark.parametrize("split_tokens", [64, 512])  # a long row over several splits, merged; every row in one
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_joins_each_heads_sink_to_its_softmax_as_the_reference_does(split_tokens, dtype):
    sinks = _loud_sinks(8)
    _assert_close(*_dense_decode(8, 2, 64, dtype, [1, 17, 300, 500], sinks=sinks, split_tokens=split_tokens), dtype)


@pytest.mark.parametrize("contexts", [[1100, 1, 190, 256], [1, 190, 256]])  # split; all within one split
def test_triton_decode_is_the_same_to_the_bit_over_wider_tables(contexts):
    """What makes a CUDA graph's step (tables as wide as the longest context served) and an eager one (tables as
    wide as the step's longest) sum alike: splits fall at the same tokens and are merged in the same order."""
    heads, kv_heads, head_dim = 8, 2, 64
    torch.manual_seed(7)
    meta = decode_metadata(contexts, 200, BLOCK_SIZE)
    cache = torch.randn(2, 200, kv_heads, BLOCK_SIZE, head_dim).to(DEVICE)
    q = torch.randn(len(contexts), heads, head_dim).to(DEVICE)
    tables, lens = meta.decode_block_tables.to(DEVICE), meta.decode_context_lens.to(DEVICE)
    wide = torch.cat([tables, torch.zeros(len(contexts), 64, dtype=tables.dtype, device=DEVICE)], 1)  # 4 more splits
    eager = paged_decode(q, cache[0], cache[1], tables, lens, head_dim**-0.5)
    assert torch.equal(paged_decode(q, cache[0], cache[1], wide, lens, head_dim**-0.5), eager)


def test_triton_decode_of_one_row_over_a_4k_context_matches_the_reference():
    _assert_close(*_dense_decode(32, 4, 128, torch.float16, [4097]), torch.float16)


def test_triton_decode_of_a_batch_of_64_matches_the_reference():
    contexts = [1 + (37 * i) % 200 for i in range(64)]
    _assert_close(*_dense_decode(8, 1, 64, torch.float16, contexts), torch.float16)


def test_triton_decode_writes_into_a_given_output_and_reads_strided_queries():
    torch.manual_seed(7)
    heads, kv_heads, dim = 4, 2, 64
    cache = torch.randn(2, 8, kv_heads, BLOCK_SIZE, dim).to(DEVICE)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim).to(DEVICE)  # q: the first columns of each row, strided
    q = qkv[:, : heads * dim].view(3, heads, dim)
    meta = decode_metadata([20, 3, 33], 8, BLOCK_SIZE)
    want = TorchPagedAttention(HeadLayout(heads, kv_heads, dim, 0.125)).decode(q.cpu(), cache.cpu(), meta)
    out = torch.zeros(5, heads, dim, device=DEVICE)
    paged_decode(q, cache[0], cache[1], meta.decode_block_tables.to(DEVICE), meta.decode_context_lens.to(DEVICE),
                 0.125, out=out[1:4])
    _assert_close(out[1:4], want, torch.float32)
    assert not out[0].any() and not out[4].any()


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES[:2])
def test_triton_decode_reads_an_8_bit_cache_as_the_dequantizing_reference_does(heads, kv_heads, head_dim, dtype,
                                                                                storage):
    torch.manual_seed(heads + 1)
    num_blocks = 80
    shape = (2, num_blocks, kv_heads, BLOCK_SIZE, head_dim)
    data = (torch.randint(-127, 128, shape, dtype=torch.int8) if storage == torch.int8
            else (torch.randn(shape) * 100).clamp(-448, 448).to(storage))
    scales = (torch.rand(2, num_blocks, kv_heads, BLOCK_SIZE) * 0.05 + 1e-3).to(dtype)
    q = torch.randn(len(CONTEXTS), heads, head_dim).to(dtype)
    meta = decode_metadata(CONTEXTS, num_blocks, BLOCK_SIZE)
    layout = HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5)
    # Keys and values dequantized to the serving dtype, as the kernel feeds them to its dot products.
    want = ScaledPagedAttention(layout).decode(q, ScaledKVCache(data, scales), meta)
    cache = ScaledKVCache(data.to(DEVICE), scales.to(DEVICE))
    meta = dataclasses.replace(meta, decode_block_tables=meta.decode_block_tables.to(DEVICE),
                               decode_context_lens=meta.decode_context_lens.to(DEVICE))
    got = TritonScaledPagedAttention(layout).attend(q.to(DEVICE), None, None, cache, meta)  # decode rows only
    _assert_close(got, want, dtype)


# (query_len, context_len) per chunk: a fresh prompt, chunks after a cached prefix (at and off block boundaries),
# a single row, one longer than a query tile.
PREFILLS = [(5, 5), (17, 40), (1, 30), (16, 48), (70, 70), (65, 200)]


def _prefill_reference(q, cache, tables, chunks, scale, sinks=None):
    out = torch.empty_like(q)
    start = 0
    for (query_len, context_len), table in zip(chunks, tables, strict=True):
        keys, values = (_gather(cache[i], table[None], context_len) for i in (0, 1))
        rows = torch.arange(query_len)[:, None] + context_len - query_len
        mask = torch.arange(context_len)[None, :] <= rows
        queries = q[start:start + query_len].transpose(0, 1)[None]
        if sinks is None:
            got = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            groups = queries.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
            scores = (queries @ keys.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
            got = softmax_with_sinks(scores, sinks) @ values
        out[start:start + query_len] = got[0].transpose(0, 1)
        start += query_len
    return out


def _prefill_inputs(chunks):
    starts, start = [], 0
    for query_len, _ in chunks:
        starts.append(start)
        start += query_len
    as_long = {"dtype": torch.long, "device": DEVICE}
    return (torch.tensor(starts, **as_long), torch.tensor([c[0] for c in chunks], **as_long),
            torch.tensor([c[1] for c in chunks], **as_long), max(c[0] for c in chunks), start)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [s for s in SHAPES if s[0] <= 12])
def test_triton_prefill_over_the_paged_context_matches_the_reference(heads, kv_heads, head_dim, dtype):
    torch.manual_seed(heads * 7 + head_dim)
    num_blocks = sum(-(-c // BLOCK_SIZE) for _, c in PREFILLS) + 2
    cache = torch.randn(2, num_blocks, kv_heads, BLOCK_SIZE, head_dim).to(dtype)
    tables = decode_metadata([c for _, c in PREFILLS], num_blocks, BLOCK_SIZE).decode_block_tables
    starts, query_lens, context_lens, max_query_len, tokens = _prefill_inputs(PREFILLS)
    q = torch.randn(tokens, heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    want = _prefill_reference(q.float(), cache.float(), tables, PREFILLS, scale)
    got = paged_prefill(q.to(DEVICE), cache[0].to(DEVICE), cache[1].to(DEVICE), tables.to(DEVICE), starts,
                        query_lens, context_lens, max_query_len, scale)
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_prefill_joins_each_heads_sink_to_its_softmax_as_the_reference_does(dtype):
    heads, kv_heads, head_dim = 8, 2, 64
    torch.manual_seed(5)
    num_blocks = sum(-(-c // BLOCK_SIZE) for _, c in PREFILLS) + 2
    cache = torch.randn(2, num_blocks, kv_heads, BLOCK_SIZE, head_dim).to(dtype)
    tables = decode_metadata([c for _, c in PREFILLS], num_blocks, BLOCK_SIZE).decode_block_tables
    starts, query_lens, context_lens, max_query_len, tokens = _prefill_inputs(PREFILLS)
    q, sinks = torch.randn(tokens, heads, head_dim).to(dtype), _loud_sinks(heads)
    want = _prefill_reference(q.float(), cache.float(), tables, PREFILLS, 0.125, sinks)
    got = paged_prefill(q.to(DEVICE), cache[0].to(DEVICE), cache[1].to(DEVICE), tables.to(DEVICE), starts,
                        query_lens, context_lens, max_query_len, 0.125, sinks=sinks.to(DEVICE))
    _assert_close(got, want, dtype)


def test_triton_prefill_of_a_chunk_after_a_4k_context_matches_the_reference():
    chunks = [(40, 4136)]
    torch.manual_seed(3)
    cache = torch.randn(2, 270, 2, BLOCK_SIZE, 64, dtype=torch.float16)
    tables = decode_metadata([4136], 270, BLOCK_SIZE).decode_block_tables
    starts, query_lens, context_lens, max_query_len, tokens = _prefill_inputs(chunks)
    q = torch.randn(tokens, 8, 64, dtype=torch.float16)
    want = _prefill_reference(q.float(), cache.float(), tables, chunks, 0.125)
    got = paged_prefill(q.to(DEVICE), cache[0].to(DEVICE), cache[1].to(DEVICE), tables.to(DEVICE), starts,
                        query_lens, context_lens, max_query_len, 0.125)
    _assert_close(got, want, torch.float16)


def test_triton_prefill_reads_an_int8_cache_as_the_dequantizing_reference_does():
    torch.manual_seed(11)
    num_blocks, chunks = 40, [(17, 40), (9, 9)]
    data = torch.randint(-127, 128, (2, num_blocks, 2, BLOCK_SIZE, 64), dtype=torch.int8)
    scales = torch.rand(2, num_blocks, 2, BLOCK_SIZE) * 0.05 + 1e-3
    tables = decode_metadata([c for _, c in chunks], num_blocks, BLOCK_SIZE).decode_block_tables
    starts, query_lens, context_lens, max_query_len, tokens = _prefill_inputs(chunks)
    q = torch.randn(tokens, 4, 64)
    want = _prefill_reference(q, data.float() * scales[..., None], tables, chunks, 0.125)
    got = paged_prefill(q.to(DEVICE), data[0].to(DEVICE), data[1].to(DEVICE), tables.to(DEVICE), starts, query_lens,
                        context_lens, max_query_len, 0.125, scales[0].to(DEVICE), scales[1].to(DEVICE))
    _assert_close(got, want, torch.float32)


def test_query_heads_must_group_evenly_over_kv_heads():
    cache = torch.zeros(4, 3, 16, 64)
    with pytest.raises(ValueError, match="groups"):
        paged_decode(torch.zeros(1, 4, 64), cache, cache, torch.zeros(1, 1, dtype=torch.long),
                     torch.ones(1, dtype=torch.long), 1.0)
