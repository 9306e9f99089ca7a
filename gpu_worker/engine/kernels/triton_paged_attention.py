"""Paged attention in Triton, straight from the block table, over a dense or an int8 / FP8 KV cache.

Both kernels read keys and values through each sequence's block table, BLOCK_N tokens at a time (a token's
block looked up per token, so BLOCK_N does not depend on the cache's block size), with an online softmax in fp32,
and never copy the context. With an 8-bit cache (`ScaledKVCache`: values [2, blocks, KVH, block_size, D], a
scale per token and head) each key and value is dequantized in registers, so the context is read at one byte a
value.

- `paged_decode`: one query token per row. One program per (row, KV head, split) serves all the query heads of
  its group (GQA) with one `tl.dot`, the group padded to 16 rows; long contexts are split every SPLIT_TOKENS
  across programs (flash-decoding) and `_combine_splits` merges the partial softmaxes, a fixed group at a time; a
  context of one split is written directly. The split count depends only on the tables' width, so a CUDA graph
  captured for a batch bucket replays it for any context lengths; it is a runtime argument, so a new count
  compiles nothing.
- `paged_prefill`: chunked prefill over the paged cache, varlen: one program per (chunk, BLOCK_M query rows,
  query head), causal within the chunk and full over the context cached before it. The chunk's own keys are
  already in the cache (written before attention), so cached and new keys are read alike.

With a sliding window (`window` tokens: a query at position p sees keys p - window + 1 .. p) both read from the
first key a row (a decode row, a prefill tile's first row) sees: a windowed decode costs the window, not the
context, and the block-table entries before it, which the KV manager may have freed (-1), are never read.

The references are `TorchPagedAttention.decode` / `_prefill` and `ScaledPagedAttention`'s, which gather the
context first. Tested in tests/gpu_worker/engine/test_triton_paged_attention.py (CUDA, or Triton's interpreter on CPU in
fp32 / fp16). Imported only where a CUDA attention is built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
# Tokens per split of a long decode context: a batch-1 decode at 8k context runs 32 programs per KV head, and
# fewer tokens would make the partials' round trip outweigh the parallelism. Fixed, so that a row's context
# splits at the same places whatever the batch or the tables' width: a CUDA graph's step (tables padded to the
# longest context served) and an eager step then sum in the same order.
SPLIT_TOKENS = 256
COMBINE_SPLIT_GROUP = 16  # splits merged at a time: 4k tokens' worth in one pass


@triton.jit
def _load_kv(ptr, scale_ptr, block_ids, cols, kv_head, rd, valid, KVH, BLOCK_SIZE: tl.constexpr,
             D: tl.constexpr, QUANTIZED: tl.constexpr, dtype: tl.constexpr):
    """Tokens `cols` of one KV head, each from its block in `block_ids`: [BLOCK_N, D_PAD] in `dtype`."""
    rows = (block_ids.to(tl.int64) * KVH + kv_head) * BLOCK_SIZE + cols % BLOCK_SIZE
    x = tl.load(ptr + rows[:, None] * D + rd[None, :], mask=valid[:, None] & (rd[None, :] < D), other=0.0)
    if QUANTIZED:
        x = x.to(tl.float32) * tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    return x.to(dtype)


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """a @ b in fp32: IEEE products for fp32 inputs (the exactness tests' dtype), tensor cores else."""
    return tl.dot(a, b, input_precision="ieee") if FP32 else tl.dot(a, b)


@triton.jit
def _attend_keys(q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, cols, valid, visible, kv_head, rd, best,
                 total, acc, scale, KVH, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, QUANTIZED: tl.constexpr,
                 FP32: tl.constexpr, UNSEEN_ROWS: tl.constexpr):
    """Keys `cols` of one sequence (`valid` ones: inside its context), read through its block table, into the
    running softmax of the queries q [rows, D_PAD]; `visible` [rows, BLOCK_N]: which query sees which key;
    UNSEEN_ROWS: whether a row may have seen no key yet. Returns the new (max, mass, unnormalized output) per query
    row."""
    block_ids = tl.load(table_ptr + cols // BLOCK_SIZE, mask=valid, other=0)
    k = _load_kv(k_ptr, k_scale_ptr, block_ids, cols, kv_head, rd, valid, KVH, BLOCK_SIZE, D, QUANTIZED, q.dtype)
    v = _load_kv(v_ptr, v_scale_ptr, block_ids, cols, kv_head, rd, valid, KVH, BLOCK_SIZE, D, QUANTIZED, q.dtype)
    s = tl.where(visible, _dot(q, tl.trans(k), FP32) * scale, float("-inf"))  # [rows, BLOCK_N]
    new_best = tl.maximum(best, tl.max(s, axis=1))
    shift = new_best
    if UNSEEN_ROWS:
        # A row that has seen no key yet (its window starts past these keys) keeps a max of -inf: exponents taken
        # against 0 instead leave it nothing (exp(-inf)) where -inf - -inf would be NaN.
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
    p = tl.exp(s - shift[:, None])
    kept = tl.exp(best - shift)
    return new_best, total * kept + tl.sum(p, axis=1), acc * kept[:, None] + _dot(p.to(v.dtype), v, FP32)


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr,
                  stats_ptr, sinks_ptr, scale, H, KVH, stride_q, stride_table, tokens_per_split, num_splits, window,
                  SPLIT: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                  D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, QUANTIZED: tl.constexpr,
                  FP32: tl.constexpr, WINDOWED: tl.constexpr, SINKS: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    split_start = split * tokens_per_split
    if split_start >= length:  # past the row's context (tables are as wide as the longest): `_combine_splits` skips it
        return
    first = split_start
    if WINDOWED:
        seen = tl.maximum(length - window, 0)  # the row's first key
        if split_start + tokens_per_split <= seen:  # wholly before the window: `_combine_splits` skips it too
            return
        first = tl.maximum(split_start, seen)  # nothing before the window's first key is read
    rg = tl.arange(0, GROUP_PAD)
    rd = tl.arange(0, D_PAD)
    rn = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + rg
    head_mask = (rg < GROUP)[:, None] & (rd[None, :] < D)
    q = tl.load(q_ptr + b * stride_q + heads[:, None] * D + rd[None, :], mask=head_mask, other=0.0)
    last = tl.minimum(split_start + tokens_per_split, length)
    best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D_PAD), tl.float32)
    for start in range(first, last, BLOCK_N):
        cols = start + rn
        valid = cols < last
        best, total, acc = _attend_keys(q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr + b * stride_table,
                                        cols, valid, valid[None, :], kv_head, rd, best, total, acc, scale, KVH,
                                        BLOCK_SIZE, D, QUANTIZED, FP32, False)  # a split's keys: all the row's
    rows = b * H + heads
    # A context of one split (the tables' width: SPLIT, known when compiling; else the row's own length) is written
    # here, with no round trip through the partials.
    if SPLIT:
        spans = length > tokens_per_split  # the row's keys span more than this split
        if WINDOWED:
            spans = (length - 1) // tokens_per_split > seen // tokens_per_split
        if spans:  # this split's unnormalized sums and its softmax's max and mass
            part_rows = rows * num_splits + split
            tl.store(part_ptr + part_rows[:, None] * D + rd[None, :], acc, mask=head_mask)
            tl.store(stats_ptr + part_rows * 2, best, mask=rg < GROUP)
            tl.store(stats_ptr + part_rows * 2 + 1, total, mask=rg < GROUP)
        else:
            _store_output(out_ptr, sinks_ptr, rows, heads, rd, best, total, acc, head_mask, rg < GROUP, D, SINKS)
    else:
        _store_output(out_ptr, sinks_ptr, rows, heads, rd, best, total, acc, head_mask, rg < GROUP, D, SINKS)


@triton.jit
def _join_sinks(best, total, sinks):
    """A softmax's running max and mass joined by its sink logit: mass and no value (gpt-oss's attention sinks, as
    `attention.softmax_with_sinks`). Returns the new mass and the factor its unnormalized output takes."""
    joined = tl.maximum(best, sinks)
    kept = tl.exp(best - joined)
    return total * kept + tl.exp(sinks - joined), kept


@triton.jit
def _store_output(out_ptr, sinks_ptr, rows, heads, rd, best, total, acc, head_mask, head_valid, D: tl.constexpr,
                  SINKS: tl.constexpr):
    if SINKS:
        total, kept = _join_sinks(best, total, tl.load(sinks_ptr + heads, mask=head_valid, other=0.0))
        acc *= kept[:, None]
    tl.store(out_ptr + rows[:, None] * D + rd[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty),
             mask=head_mask)


@triton.jit
def _combine_splits(part_ptr, stats_ptr, out_ptr, lens_ptr, sinks_ptr, H, tokens_per_split, num_splits, window,
                    SPLIT_GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, WINDOWED: tl.constexpr,
                    SINKS: tl.constexpr):
    """Merges a (row, query head)'s partial softmaxes, SPLIT_GROUP splits at a time: a fixed group, not one as wide
    as the tables, so that a CUDA graph's step and an eager one sum in the same order (on an H200, merged over 8
    lanes and over 16, the same splits and zeros beyond them, a row's output differed). With a sliding window, from
    the split of the row's first visible key (those before it wrote nothing)."""
    row = tl.program_id(0)
    length = tl.load(lens_ptr + row // H)
    row_splits = tl.cdiv(length, tokens_per_split)
    if WINDOWED:
        first_split = tl.maximum(length - window, 0) // tokens_per_split
        row_splits -= first_split
    if row_splits <= 1:  # `_paged_decode` wrote this row's output
        return
    rs = tl.arange(0, SPLIT_GROUP)
    rd = tl.arange(0, D_PAD)
    first = row * num_splits
    if WINDOWED:
        first += first_split
    best_all = tl.max(tl.load(stats_ptr + (first + rs) * 2, mask=rs < row_splits, other=float("-inf")), axis=0)
    for group in range(SPLIT_GROUP, row_splits, SPLIT_GROUP):
        best = tl.load(stats_ptr + (first + group + rs) * 2, mask=group + rs < row_splits, other=float("-inf"))
        best_all = tl.maximum(best_all, tl.max(best, axis=0))
    acc_sum = tl.zeros((D_PAD,), tl.float32)
    total_sum = tl.sum(tl.zeros((SPLIT_GROUP,), tl.float32), axis=0)
    for group in range(0, row_splits, SPLIT_GROUP):
        valid = group + rs < row_splits
        part_rows = first + group + rs
        best = tl.load(stats_ptr + part_rows * 2, mask=valid, other=float("-inf"))
        total = tl.load(stats_ptr + part_rows * 2 + 1, mask=valid, other=0.0)
        acc = tl.load(part_ptr + part_rows[:, None] * D + rd[None, :], mask=valid[:, None] & (rd[None, :] < D),
                      other=0.0)
        weight = tl.exp(best - best_all)
        acc_sum += tl.sum(acc * weight[:, None], axis=0)
        total_sum += tl.sum(total * weight, axis=0)
    if SINKS:  # the head's sink once, after its splits
        total_sum, kept = _join_sinks(best_all, total_sum, tl.load(sinks_ptr + row % H))
        acc_sum *= kept
    tl.store(out_ptr + row * D + rd, (acc_sum / total_sum).to(out_ptr.dtype.element_ty), mask=rd < D)


def _row_strided(q: torch.Tensor) -> torch.Tensor:
    """q itself where only its rows are strided (as the kernels read it), else a contiguous copy."""
    return q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 split_tokens: int = SPLIT_TOKENS, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (its rows may be strided: the fused projection's q columns); caches [blocks, KVH, block_size,
    D] (int8 / fp8 with scales [blocks, KVH, block_size], or dense); block_tables [B, max_blocks]; context_lens
    [B] (each >= 1, at most max_blocks * block_size). Writes `out` (default: a new [B, H, D] in q's dtype) and
    returns it. Contexts are split every `split_tokens` (a multiple of DECODE_BLOCK_N). `window` (None or 0: full
    attention): a row of context L sees positions max(0, L - window) .. L - 1 only; table entries for blocks wholly
    before them may be -1. `sinks` (float32 [H]): each head's sink logit joined to its softmax (gpt-oss)."""
    q = _row_strided(q)
    batch, heads, dim = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split into groups over {kv_heads} KV heads")
    num_splits = triton.cdiv(block_tables.shape[1] * block_size, split_tokens)
    out = q.new_empty(q.shape) if out is None else out
    part = stats = out  # unused with one split
    if num_splits > 1:
        part = torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(batch, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    group, quantized = heads // kv_heads, k_scale is not None
    d_pad = max(16, triton.next_power_of_2(dim))
    _paged_decode[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale if quantized else k_cache, v_scale if quantized else v_cache,
        block_tables, context_lens, out, part, stats, q if sinks is None else sinks, scale, heads, kv_heads,
        q.stride(0), block_tables.stride(0), split_tokens, num_splits, window or 0, SPLIT=num_splits > 1, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_BLOCK_N, QUANTIZED=quantized, FP32=q.dtype == torch.float32, WINDOWED=bool(window),
        SINKS=sinks is not None)
    if num_splits > 1:
        _combine_splits[(batch * heads,)](part, stats, out, context_lens, q if sinks is None else sinks, heads,
                                          split_tokens, num_splits, window or 0, SPLIT_GROUP=COMBINE_SPLIT_GROUP, D=dim,
                                          D_PAD=d_pad, WINDOWED=bool(window), SINKS=sinks is not None)
    return out


@triton.jit
def _paged_prefill(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, starts_ptr, query_lens_ptr,
                   context_lens_ptr, out_ptr, sinks_ptr, scale, H, KVH, stride_q, stride_table, window,
                   GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANTIZED: tl.constexpr, FP32: tl.constexpr,
                   WINDOWED: tl.constexpr, SINKS: tl.constexpr):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    query_len = tl.load(query_lens_ptr + chunk)
    if tile * BLOCK_M >= query_len:
        return
    start = tl.load(starts_ptr + chunk)
    context_len = tl.load(context_lens_ptr + chunk)
    kv_head = head // GROUP
    rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, D_PAD)
    rn = tl.arange(0, BLOCK_N)
    row_mask = (rm < query_len)[:, None] & (rd[None, :] < D)
    q = tl.load(q_ptr + (start + rm)[:, None] * stride_q + head * D + rd[None, :], mask=row_mask, other=0.0)
    positions = context_len - query_len + rm  # each query row's position: it sees keys 0..position
    # Keys up to the tile's last row's position (rows past the chunk's end see nothing more).
    end = context_len - query_len + tl.minimum(tile * BLOCK_M + BLOCK_M, query_len)
    seen = 0  # the first key the tile's first row sees
    if WINDOWED:
        seen = tl.maximum(context_len - query_len + tile * BLOCK_M - window + 1, 0)
        # Rows past the chunk's end (not stored) take its last row's position, so that they too see a key: none would
        # leave them 0 / 0.
        positions = context_len - query_len + tl.minimum(rm, query_len - 1)
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    for key_start in range(seen, end, BLOCK_N):
        cols = key_start + rn
        valid = cols < end
        visible = valid[None, :] & (cols[None, :] <= positions[:, None])
        if WINDOWED:
            visible = visible & (cols[None, :] > positions[:, None] - window)
        best, total, acc = _attend_keys(q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
                                        tables_ptr + chunk * stride_table, cols, valid, visible, kv_head, rd, best,
                                        total, acc, scale, KVH, BLOCK_SIZE, D, QUANTIZED, FP32, WINDOWED)
    if SINKS:
        total, kept = _join_sinks(best, total, tl.load(sinks_ptr + head))
        acc *= kept[:, None]
    out = acc / total[:, None]
    tl.store(out_ptr + ((start + rm) * H + head)[:, None] * D + rd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                  max_query_len: int, scale: float, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for prefill chunks whose keys and values are in the cache already. q [T, H, D]: the step's
    rows (they may be strided), chunk c's from query_starts[c] for query_lens[c]; block_tables [C, max_blocks];
    context_lens [C]: each chunk's tokens, itself included. Writes the chunks' rows of `out` (default: a new
    [T, H, D]) and returns it. `window` (None or 0: full attention): a row at position p sees keys
    max(0, p - window + 1) .. p only; table entries for blocks wholly before a chunk's first row's may be -1.
    `sinks` (float32 [H]): each head's sink logit joined to its softmax (gpt-oss)."""
    q = _row_strided(q)
    _, heads, dim = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split into groups over {kv_heads} KV heads")
    out = q.new_empty(q.shape) if out is None else out
    quantized = k_scale is not None
    grid = (block_tables.shape[0], triton.cdiv(max_query_len, PREFILL_BLOCK_M), heads)
    _paged_prefill[grid](
        q, k_cache, v_cache, k_scale if quantized else k_cache, v_scale if quantized else v_cache,
        block_tables, query_starts, query_lens, context_lens, out, q if sinks is None else sinks, scale, heads,
        kv_heads, q.stride(0), block_tables.stride(0), window or 0,
        GROUP=heads // kv_heads, D=dim, D_PAD=max(16, triton.next_power_of_2(dim)), BLOCK_SIZE=block_size,
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, QUANTIZED=quantized, FP32=q.dtype == torch.float32,
        WINDOWED=bool(window), SINKS=sinks is not None)
    return out
