"""Linear kernels for quantized weights, plugged in behind `Linear`'s kernel interface.

`DequantLinearKernel` is the reference (and, until the Triton kernels land, the CUDA path): it dequantizes
the weight and runs the dense matmul, so a quantized model in float32 computes exactly what a dense model
holding the dequantized weights computes. The CPU kernels call torch's own int8/int4 weight-only ops, which
read 1 or 0.5 bytes per weight where the bf16 path reads 2 (decode at small batch is bound by those reads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .weights import Int4Weight, Int8Weight, QuantizedWeight


class DequantLinearKernel:
    def __init__(self, weight: QuantizedWeight):
        self.weight = weight

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize().to(x.dtype), bias)


class CpuInt8LinearKernel:
    """`aten._weight_int8pack_mm`: x [M, K] bf16 or fp32 times int8 [N, K] with per-row scales."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype):
        self.q = weight.q
        self.scale = weight.scale.to(dtype)

    @staticmethod
    def supports(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        # The op reads past the row end when K is not a multiple of 32 (it crashed on K = 70 here).
        return (isinstance(weight, Int8Weight) and device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
                and weight.shape[1] % 32 == 0)

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale)
        return y if bias is None else y + bias


class CpuInt4LinearKernel:
    """`aten._weight_int4pack_mm_for_cpu`: w = (q - 8) * scale + zero per group, the weight in torch's own
    blocked int4 layout (packed once here), scales and zeros in the activation dtype."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype):
        self.group_size = weight.group_size
        self.input_perm = weight.input_perm
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1)
        self.scale_and_zero = torch.stack([weight.scale.T, weight.zero.T], dim=-1).to(dtype).contiguous()

    @staticmethod
    def supports(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        # Not fp16: the op takes its scales in the activation dtype, and fp16 matmuls on CPU are very slow.
        return (isinstance(weight, Int4Weight) and device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
                and weight.group_size in (32, 64, 128, 256) and weight.shape[0] % 16 == 0)

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size,
                                                       self.scale_and_zero)
        return y if bias is None else y + bias


def quantized_linear_kernel(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    """The fastest kernel this device has for `weight`; the reference where none applies."""
    for kernel in (CpuInt8LinearKernel, CpuInt4LinearKernel):
        if kernel.supports(weight, dtype, device):
            return kernel(weight, dtype)
    return DequantLinearKernel(weight)

