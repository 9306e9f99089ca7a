"""The model's element-wise ops behind one interface: `TorchOps`, the reference of each, and the native CPU kernels
or the Triton ones (CUDA) as its subclasses, each handing a tensor it does not take to the reference.
`kernel_choice` picks one set per model.

bf16 element-wise ops in torch on CPU take several passes over memory and round between them; the kernels in
`kernels/elementwise.h` (built for AVX-512, or AVX2 where the CPU has no AVX512-BF16) do the same math with the same
bf16 rounding in one pass. On CUDA each torch op is a launch and a round trip through memory; `kernels/triton_ops.py`
makes each op one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .rope import apply_rotary


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's rounding: normalize in float32, round to the model dtype, then scale.
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu_and_mul_reference(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """transformers' gpt-oss expert activation, operation for operation."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def rotary_reference_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    qk = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    qk.copy_(apply_rotary(qk, cos[:, None, :], sin[:, None, :]))


# HF's `hidden_act` -> the op computing act(gate) * up
GATED_ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


class TorchOps:
    """The references: what the kernels are tested against, and what serves where none applies."""

    module = None  # the native module whose kernels serve, if any
    # A mixture of experts in one kernel over its experts' stacked weights (`moe.SparseMoE`), where there is one:
    # fused_moe(x, w_gate_up, w_down, weights, experts, activation), `moe.fused_moe_reference`'s contract.
    fused_moe = None

    def fused_moe_serves(self, *weights: torch.Tensor | None) -> bool:
        """Whether `fused_moe` takes experts whose weights are these (a quantized linear's weight is None)."""
        return False

    def fused_moe_takes(self, rows: int, num_experts: int, top_k: int) -> bool:
        """Whether `fused_moe` serves a step of `rows` rows (else each expert's kernels do, `moe.mixture`)."""
        return True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_reference(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add fused into the norm that follows it."""
        return add_rms_norm_reference(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] = [gate | up] -> silu(gate) * up."""
        return silu_and_mul_reference(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] = [gate | up] -> gelu_tanh(gate) * up (Gemma's GeGLU)."""
        return gelu_tanh_and_mul_reference(x)

    def clamped_swiglu_and_mul(self, x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """[T, 2I] = [gate | up] -> (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at limit and up
        to ±limit first (gpt-oss's experts); every op set serves it by this reference."""
        return clamped_swiglu_and_mul_reference(x, alpha, limit)

    def rotary_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
        """Rotate, in place, the first `heads` heads of each [T, W] row: q and k heads sit side by side."""
        rotary_reference_(qkv, cos, sin, heads, head_dim)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax, first index on ties; exact on model-dtype logits (upcasting changes no order)."""
        return logits.argmax(dim=-1)


# The most (token, expert) pairs per expert, on average, for which the native grouped product serves a mixture.
FUSED_MOE_PAIRS_PER_EXPERT = 8


class NativeCpuOps(TorchOps):
    """bf16 on CPU by a native module's kernels (`kernels.NativeKernels.bf16`): contiguous bf16 tensors whose rows
    (or heads) are a multiple of 32 wide."""

    def __init__(self, module, fuses_mixtures: bool = True):
        """`fuses_mixtures`: whether decode-sized mixture-of-experts steps run `fused_moe`; not in batch-invariant
        mode, where every step's experts run the row-invariant product (a token's result then does not depend on
        how many rows share its step)."""
        self.module = module
        self.fuses_mixtures = fuses_mixtures

    def rms_norm(self, x, weight, eps):
        return self.module.rms_norm_bf16(x, weight, eps) if _takes(x, x.shape[-1]) else super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if _takes(x, x.shape[-1]) and residual.is_contiguous():
            return tuple(self.module.add_rms_norm_bf16(x, residual, weight, eps))
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        return self.module.silu_and_mul_bf16(x) if _takes(x, x.shape[-1]) else super().silu_and_mul(x)

    def rotary_(self, qkv, cos, sin, heads, head_dim):
        if _takes(qkv, head_dim):
            self.module.rotary_inplace_bf16(qkv, cos, sin, heads, head_dim)
        else:
            super().rotary_(qkv, cos, sin, heads, head_dim)

    def argmax(self, logits):
        return self.module.argmax_bf16(logits) if _takes(logits) else super().argmax(logits)

    def fused_moe_serves(self, *weights):
        return (self.fuses_mixtures and hasattr(self.module, "moe_silu_bf16") and len(weights) > 0
                and all(isinstance(w, torch.Tensor) and w.device.type == "cpu" and _takes(w, w.shape[-1])
                        for w in weights))

    def fused_moe_takes(self, rows, num_experts, top_k):
        """Decode-sized steps, a few pairs per expert: one parallel region for the whole mixture saves one per
        expert and projection and the torch ops around them; past them oneDNN's blocked matmul per expert wins
        (`tokenfleet bench engine --model tokenfleet-moe`)."""
        return rows * top_k <= FUSED_MOE_PAIRS_PER_EXPERT * num_experts

    def fused_moe(self, x, w_gate_up, w_down, weights, experts, activation="silu"):
        """The mixture of SwiGLU experts (the only ones a `moe.SparseMoE` fuses) in one native call
        (`kernels/moe_kernels.cpp`)."""
        if activation != "silu":
            raise ValueError(f"the native mixture runs SwiGLU experts, not {activation}")
        return self.module.moe_silu_bf16(x, w_gate_up, w_down, weights.to(x.dtype).contiguous(),
                                         experts.contiguous())


def _takes(x: torch.Tensor, vector_width: int = 0) -> bool:
    return x.dtype == torch.bfloat16 and vector_width % 32 == 0 and x.is_contiguous()


class TritonOps(TorchOps):
    """CUDA: each op one Triton kernel (`kernels/triton_ops.py`), over contiguous tensors; argmax stays torch's."""

    def __init__(self):
        from .kernels import triton_moe, triton_ops

        self.triton = triton_ops
        self.fused_moe = triton_moe.fused_moe
        self.fused_moe_serves = triton_moe.serves

    def rms_norm(self, x, weight, eps):
        return self.triton.rms_norm(x, weight, eps)[0] if x.is_contiguous() else super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if x.is_contiguous() and residual.is_contiguous():
            return self.triton.rms_norm(x, weight, eps, residual)
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        return self.triton.silu_and_mul(x) if x.is_contiguous() else super().silu_and_mul(x)

    def rotary_(self, qkv, cos, sin, heads, head_dim):
        if qkv.is_contiguous():
            self.triton.rotary_(qkv, cos, sin, heads, head_dim)
        else:
            super().rotary_(qkv, cos, sin, heads, head_dim)
