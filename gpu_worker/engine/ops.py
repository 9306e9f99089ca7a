"""Element-wise model ops with a torch reference each, the native CPU kernel or the Triton one (CUDA) where
they apply.

bf16 element-wise ops in torch on CPU run several times slower than their fp32 math needs; the kernels in
`kernels/elementwise.h` (built for AVX-512, or AVX2 where the CPU has no AVX512-BF16) do the same math with the
same bf16 rounding, in one pass. On CUDA each torch op is a launch and a round trip through memory;
`kernels/triton_ops.py` makes each op one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import bf16_kernels, triton_available
from .rope import apply_rotary


def _native(x: torch.Tensor, vector_width: int = 0):
    """The native element-wise kernels where they apply: contiguous bf16 on CPU, `vector_width` a multiple of 32."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or vector_width % 32 or not x.is_contiguous():
        return None
    return bf16_kernels()


def _triton(x: torch.Tensor):
    """The Triton kernels where they apply: contiguous tensors on CUDA."""
    if x.device.type != "cuda" or not x.is_contiguous() or not triton_available():
        return None
    from .kernels import triton_ops

    return triton_ops


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's rounding: normalize in float32, round to the model dtype, then scale.
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if triton := _triton(x):
        return triton.rms_norm(x, weight, eps)[0]
    native = _native(x, x.shape[-1])
    return native.rms_norm_bf16(x, weight, eps) if native else rms_norm_reference(x, weight, eps)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the residual stream's add fused into the norm that follows it."""
    if (triton := _triton(x)) and residual.is_contiguous():
        return triton.rms_norm(x, weight, eps, residual)
    native = _native(x, x.shape[-1])
    if native and residual.is_contiguous():
        return tuple(native.add_rms_norm_bf16(x, residual, weight, eps))
    return add_rms_norm_reference(x, residual, weight, eps)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up."""
    if triton := _triton(x):
        return triton.silu_and_mul(x)
    native = _native(x, x.shape[-1])
    return native.silu_and_mul_bf16(x) if native else silu_and_mul_reference(x)


def rotary_reference_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    qk = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    qk.copy_(apply_rotary(qk, cos[:, None, :], sin[:, None, :]))


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotate, in place, the first `heads` heads of each [T, W] row: q and k heads sit side by side."""
    if triton := _triton(qkv):
        triton.rotary_(qkv, cos, sin, heads, head_dim)
        return
    native = _native(qkv, head_dim)
    if native:
        native.rotary_inplace_bf16(qkv, cos, sin, heads, head_dim)
    else:
        rotary_reference_(qkv, cos, sin, heads, head_dim)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, first index on ties; exact on model-dtype logits (upcasting changes no order)."""
    native = _native(logits)
    return native.argmax_bf16(logits) if native else logits.argmax(dim=-1)
