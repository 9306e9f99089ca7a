"""Paged decode attention in Triton, straight from the block table, over a dense or an int8 / FP8 KV cache.

One program per (sequence, KV head): it reads that head's keys and values block by block through the sequence's
block table, once for all the query heads of its group (GQA), with an online softmax in fp32. With an 8-bit
cache (`ScaledKVCache`: values [2, blocks, KVH, block_size, D], a scale per token and head) each key and value is
dequantized in registers, so the context is read at one byte a value and never copied; the references are
`TorchPagedAttention.decode` / `ScaledPagedAttention.decode`, which gather the whole context first. Tested in
tests/engine/test_triton_paged_attention.py (CUDA, or Triton's interpreter on CPU in fp32 / fp16). Imported only
where a CUDA attention is built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, lens_ptr, out_ptr, scale, KVH,
                  stride_table, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    rg = tl.arange(0, GROUP_PAD)
    rd = tl.arange(0, D)
    rt = tl.arange(0, BLOCK_SIZE)
    heads = h * GROUP + rg
    q = tl.load(q_ptr + (b * KVH * GROUP + heads)[:, None] * D + rd[None, :], mask=(rg < GROUP)[:, None],
                other=0.0).to(tl.float32)
    length = tl.load(lens_ptr + b)
    best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    for i in range(0, tl.cdiv(length, BLOCK_SIZE)):
        block = tl.load(tables_ptr + b * stride_table + i)
        valid = i * BLOCK_SIZE + rt < length
        rows = (block * KVH + h) * BLOCK_SIZE + rt  # this head's rows of the block
        k = tl.load(k_ptr + rows[:, None] * D + rd[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * D + rd[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        if QUANTIZED:
            k = k * tl.load(k_scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
            v = v * tl.load(v_scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_SIZE]
        s = tl.where(valid[None, :], s, float("-inf"))
        new_best = tl.maximum(best, tl.max(s, axis=1))
        p = tl.exp(s - new_best[:, None])
        kept = tl.exp(best - new_best)
        total = total * kept + tl.sum(p, axis=1)
        acc = acc * kept[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        best = new_best
    out = acc / total[:, None]
    tl.store(out_ptr + (b * KVH * GROUP + heads)[:, None] * D + rd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rg < GROUP)[:, None])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D]; caches [blocks, KVH, block_size, D] (int8 with scales [blocks, KVH, block_size], or dense);
    block_tables [B, max_blocks]; context_lens [B] (each >= 1). Returns [B, H, D] in q's dtype."""
    batch, heads, dim = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    if heads % kv_heads or dim & (dim - 1) or block_size & (block_size - 1):
        raise ValueError("whole query groups, and head_dim and block_size powers of two")
    group = heads // kv_heads
    out = torch.empty_like(q)
    quantized = k_scale is not None
    _paged_decode[(batch, kv_heads)](
        q.contiguous(), k_cache, v_cache, k_scale if quantized else k_cache, v_scale if quantized else v_cache,
        block_tables.contiguous(), context_lens.contiguous(), out, scale, kv_heads, block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), D=dim, BLOCK_SIZE=block_size, QUANTIZED=quantized)
    return out
