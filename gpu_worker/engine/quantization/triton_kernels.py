"""Triton GEMMs for quantized weights on CUDA: w8a16 and w4a16 (int4, or MXFP4 as gpt-oss stores its experts), the
weight dequantized in registers.

Each program computes a BLOCK_M x BLOCK_N tile of y = x @ W.T over blocks of 32 inputs (the smallest group size
our formats have, so a block never straddles two groups). The integers go into `tl.dot` as they are (exact in
fp16 / bf16) and the group's scale multiplies the block's fp32 product, so int8 computes with the exact weight;
int4's w = q * scale + offset adds offset * sum(x) per block; MXFP4's FP4 values are decoded to floats (exact in
fp16 / bf16) and its power-of-two scale multiplies the block's product. The references are `DequantLinearKernel` (the
dequantized weight's matmul); tests/gpu_worker/engine/test_quant_triton.py checks both under
`TRITON_INTERPRET=1` in fp32 and fp16 on CPU (the interpreter is wrong in bf16). Imported only when a CUDA kernel
is built: the CPU path never needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 32


@triton.jit
def _dot(x, q, FP32: tl.constexpr):
    """x @ q (integers, or FP4 values: exact in x's dtype) accumulated in fp32: IEEE fp32 products for fp32 x (the
    tests' dtype), tensor cores else."""
    return tl.dot(x, q.to(tl.float32), input_precision="ieee") if FP32 else tl.dot(x, q.to(x.dtype))


@triton.jit
def _int8_matmul(x_ptr, q_ptr, scale_ptr, y_ptr, M, N, K, group_size, stride_xm, stride_qn, stride_sn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        q = tl.load(q_ptr + rn[None, :] * stride_qn + (k0 + rk)[:, None], mask=rn[None, :] < N, other=0)
        s = tl.load(scale_ptr + rn * stride_sn + k0 // group_size, mask=rn < N, other=0.0)
        acc += _dot(x, q, FP32) * s[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _nibble_block(x_ptr, w_ptr, rm, rn, ri, k0, M, N, stride_xm, stride_wn):
    """A block of 32 inputs from k0 of packed nibbles (input 2i in byte i's low nibble, 2i + 1 in its high one):
    rows rm's even inputs, their odd ones, and the weight rows rn's bytes [16, BLOCK_N]. The even inputs meet the low
    nibbles, the odd ones the high nibbles, in two dots (no interleaving in registers)."""
    x_row = x_ptr + rm[:, None] * stride_xm + k0 + 2 * ri[None, :]
    x_even = tl.load(x_row, mask=rm[:, None] < M, other=0.0)
    x_odd = tl.load(x_row + 1, mask=rm[:, None] < M, other=0.0)
    return x_even, x_odd, tl.load(w_ptr + rn[None, :] * stride_wn + k0 // 2 + ri[:, None], mask=rn[None, :] < N,
                                  other=0)


@triton.jit
def _int4_matmul(x_ptr, packed_ptr, scale_ptr, offset_ptr, y_ptr, M, N, K, group_size, stride_xm, stride_pn,
                 stride_sn, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FP32: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_even, x_odd, p = _nibble_block(x_ptr, packed_ptr, rm, rn, ri, k0, M, N, stride_xm, stride_pn)
        group = k0 // group_size
        s = tl.load(scale_ptr + rn * stride_sn + group, mask=rn < N, other=0.0)
        o = tl.load(offset_ptr + rn * stride_sn + group, mask=rn < N, other=0.0)
        lo, hi = p & 0xF, p >> 4
        block = _dot(x_even, lo, FP32) + _dot(x_odd, hi, FP32)
        x_sum = tl.sum(x_even.to(tl.float32), axis=1) + tl.sum(x_odd.to(tl.float32), axis=1)
        acc += block * s[None, :] + x_sum[:, None] * o[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _fp4(nibble):
    """e2m1 nibbles to their values: sign, 2 exponent bits, 1 mantissa bit (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    exponent, mantissa = (nibble >> 1) & 3, (nibble & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, (2.0 + mantissa) * (1 << exponent).to(tl.float32) * 0.25)
    return tl.where((nibble & 8) != 0, -magnitude, magnitude)


@triton.jit
def _mxfp4_matmul(x_ptr, blocks_ptr, scale_ptr, y_ptr, M, N, K, group_size, stride_xm, stride_bn, stride_sn,
                  stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr):
    # As _int4_matmul; a block of 32 inputs is one group, whose E8M0 exponent e scales its product by 2^(e - 127).
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_even, x_odd, p = _nibble_block(x_ptr, blocks_ptr, rm, rn, ri, k0, M, N, stride_xm, stride_bn)
        e = tl.load(scale_ptr + rn * stride_sn + k0 // group_size, mask=rn < N, other=127)
        lo, hi = _fp4(p & 0xF), _fp4(p >> 4)
        block = _dot(x_even, lo, FP32) + _dot(x_odd, hi, FP32)
        acc += block * tl.exp2(e.to(tl.float32) - 127.0)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _blocks(m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): decode's few rows in one 16-row block (tl.dot's smallest), wider tiles for more."""
    return (16, 64) if m <= 16 else (64, 64)


def _launch(kernel, x: torch.Tensor, weight: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T by `kernel`, W given as its data [N, ...], scale [N, K / G] and any offset."""
    m, k = x.shape
    data, scale = weight[0], weight[1]
    n = data.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n = _blocks(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    kernel[grid](x, *weight, y, m, n, k, k // scale.shape[1], x.stride(0), data.stride(0), scale.stride(0),
                 y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, FP32=x.dtype == torch.float32)
    return y


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (q * scale).T, scale float32 [N, K / G] (G a multiple of 32)."""
    return _launch(_int8_matmul, x, (q, scale))


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (q * scale + offset).T, q the nibbles of packed [N, K / 2], scale/offset float32
    [N, K / G]."""
    return _launch(_int4_matmul, x, (packed, scale, offset))


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T, W in MXFP4: the FP4 nibbles of blocks [N, K / 2], E8M0 scales uint8 [N, K / 32]."""
    return _launch(_mxfp4_matmul, x, (blocks, scales))
