"""The model's element-wise ops in Triton for CUDA, each one pass over its rows: RMSNorm (with the residual add
fused), SiLU·mul, and rotary embedding fused with the KV-cache write.

Math is in fp32 and rounds where the references (`ops.*_reference`) round to the model dtype: the normalized
row before the weight multiplies it, the residual sum before it is normalized. Tested against them in
tests/gpu_worker/engine/test_triton_ops.py (CUDA, or Triton's interpreter on CPU in fp32 / fp16). Imported only on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024


@triton.jit
def _rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, N, eps, ADD: tl.constexpr,
              BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(summed_ptr.dtype.element_ty)  # the residual stream is kept in the model dtype
        tl.store(summed_ptr + row * N + cols, x, mask=mask)
    x = x.to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + cols, (normed.to(tl.float32) * weight.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x [+ residual]) * weight, x [+ residual]) over the last dimension of a contiguous x."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    block = triton.next_power_of_2(n)
    _rms_norm[(x.numel() // n,)](x, x if residual is None else residual, weight, out, summed, n, eps,
                                 ADD=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out, summed


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] (contiguous) -> silu(gate) * up."""
    n = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], n)
    _silu_and_mul[(x.numel() // (2 * n), triton.cdiv(n, SILU_BLOCK))](x, out, n, BLOCK=SILU_BLOCK)
    return out


@triton.jit
def _rotary(qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_blocks_ptr, slot_offsets_ptr, stride_qkv,
            H, KVH, BLOCK_SIZE, HALF: tl.constexpr, HALF_PAD: tl.constexpr, WRITE: tl.constexpr):
    """Program (token, head) over the q and k heads: rotate the head in place; a k head, and its v head, also go
    into the cache at the token's slot."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    D = 2 * HALF
    ri = tl.arange(0, HALF_PAD)
    mask = ri < HALF
    row = qkv_ptr + t * stride_qkv + head * D
    x1 = tl.load(row + ri, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + ri, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * D + ri, mask=mask, other=0.0).to(tl.float32)  # cos and sin repeat after HALF
    sin = tl.load(sin_ptr + t * D + ri, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty)
    tl.store(row + ri, y1, mask=mask)
    tl.store(row + HALF + ri, y2, mask=mask)
    if WRITE:  # noqa: SIM102 (a constexpr and a tensor do not mix in one Triton condition)
        if head >= H:
            kv_head = head - H
            block = tl.load(slot_blocks_ptr + t).to(tl.int64)
            slot = ((block * KVH + kv_head) * BLOCK_SIZE + tl.load(slot_offsets_ptr + t)) * D
            tl.store(k_cache_ptr + slot + ri, y1.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_cache_ptr + slot + HALF + ri, y2.to(k_cache_ptr.dtype.element_ty), mask=mask)
            v_row = row + KVH * D  # this KV head's v columns sit KVH heads past its k columns
            tl.store(v_cache_ptr + slot + ri, tl.load(v_row + ri, mask=mask, other=0.0), mask=mask)
            tl.store(v_cache_ptr + slot + HALF + ri, tl.load(v_row + HALF + ri, mask=mask, other=0.0), mask=mask)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotate, in place, the first `heads` heads of each [T, W] row (q and k heads side by side)."""
    _launch_rotary(qkv, cos, sin, heads, 0, head_dim, None, None, None)


def rotary_and_write_kv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                         num_kv_heads: int, head_dim: int, kv_cache: torch.Tensor, slot_blocks: torch.Tensor,
                         slot_offsets: torch.Tensor) -> None:
    """Rotate the q and k heads of the fused projection [T, (H + 2 KVH) D] in place and write each token's k and v
    heads into kv_cache [2, blocks, KVH, block_size, D] at (slot_blocks[t], slot_offsets[t])."""
    _launch_rotary(qkv, cos, sin, num_heads, num_kv_heads, head_dim, kv_cache, slot_blocks, slot_offsets)


def _launch_rotary(qkv, cos, sin, heads, kv_heads, head_dim, kv_cache, slot_blocks, slot_offsets) -> None:
    if qkv.stride(1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rotary needs rows of contiguous columns and contiguous cos / sin")
    write = kv_cache is not None
    k_cache, v_cache = (kv_cache[0], kv_cache[1]) if write else (qkv, qkv)
    half = head_dim // 2
    _rotary[(qkv.shape[0], heads + kv_heads)](
        qkv, cos, sin, k_cache, v_cache, slot_blocks if write else cos, slot_offsets if write else cos,
        qkv.stride(0), heads, kv_heads, k_cache.shape[-2] if write else 1, HALF=half,
        HALF_PAD=triton.next_power_of_2(half), WRITE=write)
