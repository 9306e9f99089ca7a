"""A mixture of experts' MLPs in Triton for CUDA, as vLLM's `fused_moe` does it: one grouped GEMM over all the
(token, expert) pairs for each projection, instead of one matmul per chosen expert (`moe.mixture`).

`align_by_expert` sorts the pairs by expert and pads each expert's run to whole blocks of BLOCK_M, so a block of
pairs belongs to one expert; each program of `_grouped_gemm` gathers its block's rows, multiplies them by that
expert's slice of the stacked weight [E, N, K] and scatters the products back to the pairs' rows. Gate and up
then down: [T, H] -> [T k, 2I] -> act(gate) * up [T k, I] -> [T k, H] weighted by the router -> summed over k.
No step reads a count back to the host, as capturing a decode step in a CUDA graph needs (capture not yet
tried).

Math is in fp32 and rounds to the model dtype where `moe.fused_moe_reference` rounds: after each projection,
after the activation; the routing weight multiplies the down projection's fp32 product before it rounds. Tested
against it in tests/gpu_worker/engine/test_triton_moe.py (CUDA, or Triton's interpreter on CPU in fp32 / fp16).
Imported only on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 32
ACTIVATION_BLOCK = 1024
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # HF's names, as `ops.GATED_ACTIVATIONS` has them


def serves(*weights: torch.Tensor | None) -> bool:
    """Whether `fused_moe` takes a mixture whose experts' weights are these: dense float tensors of one dtype on
    CUDA (a quantized linear's weight is None). Else each expert's `MLP` serves (`moe.mixture`)."""
    dtype = weights[0].dtype if weights and isinstance(weights[0], torch.Tensor) else None
    return (dtype in (torch.float16, torch.bfloat16, torch.float32)
            and all(isinstance(w, torch.Tensor) and w.is_cuda and w.dtype == dtype for w in weights))


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Pairs per block: the smallest of 16 (tl.dot's least), 32 and 64 that holds an expert's average share, so a
    decode step pads each chosen expert's few rows to 16, not 64, and a prefill fills wide blocks."""
    average = -(-num_pairs // num_experts)
    return next((m for m in (16, 32) if average <= m), 64)


def align_by_expert(experts: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's choices [T, k] grouped for the grouped GEMM. Pair p is (token p // k, its (p % k)-th expert).

    Returns sorted_ids (int32): the pairs ordered by expert (by token within one), each expert's run padded with
    T k (no pair) to a multiple of block_m; block_experts (int32): the expert of each block of block_m of them;
    num_padded (int32 [1]): how many of sorted_ids are used; the blocks past it are not. An expert no token chose
    has no block. sorted_ids is sized for the most padding the shape allows, so nothing waits on the counts."""
    pairs = experts.flatten().long()
    num_pairs = pairs.numel()
    order = torch.argsort(pairs, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=pairs.device)
    counts.index_add_(0, pairs, torch.ones_like(pairs))  # bincount, without its read of the max back to the host
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    by_expert = pairs[order]
    rank = torch.arange(num_pairs, device=pairs.device) - (counts.cumsum(0) - counts)[by_expert]
    # Every expert pads at most block_m - 1 slots, and at most min(E, T k) experts are chosen.
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=pairs.device)
    sorted_ids[(padded_ends - padded)[by_expert] + rank] = order.int()
    block_starts = torch.arange(0, capacity, block_m, device=pairs.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_experts.int(), padded_ends[-1:].int()


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """IEEE fp32 products for fp32 (the tests' dtype), tensor cores for 16-bit."""
    return tl.dot(a, b, input_precision="ieee") if FP32 else tl.dot(a, b)


@triton.jit
def _grouped_gemm(a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr, N, K,
                  num_pairs, top_k, stride_am, stride_be, stride_bn, stride_cm, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP32: tl.constexpr):
    """Program (block of pairs, tile of N): c[pair, n] = a[pair // top_k] . b[expert, n] (* weight[pair])."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pair < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + expert * stride_be + rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_rows + ks[None, :], mask=real[:, None] & (ks[None, :] < K), other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=(rn[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc += _dot(a, b, FP32)
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pair, mask=real, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=real[:, None] & (rn[None, :] < N))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor, block_experts: torch.Tensor,
                 num_padded: torch.Tensor, top_k: int, block_m: int,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
    """c [P, N], P = a's rows x top_k: row p = a[p // top_k] @ w[expert of p].T, times weights.flatten()[p] where
    given; w the experts' weights stacked [E, N, K]. The pairs come grouped by `align_by_expert`."""
    num_pairs, (_, n, k) = a.shape[0] * top_k, w.shape
    if a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("grouped_gemm needs rows of contiguous columns in a and w")
    c = a.new_empty(num_pairs, n)
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, BLOCK_N))
    _grouped_gemm[grid](a, w, c, c if weights is None else weights.contiguous(), sorted_ids, block_experts,
                        num_padded, n, k, num_pairs, top_k, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
                        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, MUL_WEIGHT=weights is not None,
                        FP32=a.dtype == torch.float32)
    return c


@triton.jit
def _gated(x_ptr, out_ptr, N, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # a long prefill's T k rows of 2I pass int32
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(u)) = g sigmoid(2u): no tanh needed, and exact at both tails
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1 + tl.exp(-2 * u))
    else:
        act = gate / (1 + tl.exp(-gate))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)  # the reference rounds act(gate) before the product
    tl.store(out_ptr + row * N + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gated(x: torch.Tensor, activation: str) -> torch.Tensor:
    """[P, 2I] = [gate | up] (contiguous) -> act(gate) * up; act silu or tanh-approximated GELU (HF's names). Both
    here, as triton_ops has silu only."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"no gated activation {activation!r}; one of {', '.join(ACTIVATIONS)}")
    rows, n = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, n)
    if rows:
        _gated[(rows, triton.cdiv(n, ACTIVATION_BLOCK))](x, out, n, GELU=activation == "gelu_pytorch_tanh",
                                                         BLOCK=ACTIVATION_BLOCK)
    return out


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Sum over each token's k chosen experts of weight x expert(token), every expert a gated MLP.

    x [T, H]; w_gate_up [E, 2I, H], each expert's gate rows then its up rows (`MLP.gate_up_proj`); w_down [E, H, I];
    weights and experts [T, k], as `moe.route` returns them; activation one of ACTIVATIONS."""
    tokens, top_k = experts.shape
    if tokens == 0:
        return torch.zeros_like(x)
    block_m = block_m_for(tokens * top_k, w_gate_up.shape[0])
    grouping = align_by_expert(experts, w_gate_up.shape[0], block_m)
    gate_up = grouped_gemm(x, w_gate_up, *grouping, top_k=top_k, block_m=block_m)
    per_pair = grouped_gemm(gated(gate_up, activation), w_down, *grouping, top_k=1, block_m=block_m,
                            weights=weights)
    return per_pair.view(tokens, top_k, -1).sum(dim=1)
