"""Linear kernels for quantized weights, plugged in behind `Linear`'s kernel interface.

`DequantLinearKernel` is the reference (and, until the Triton kernels land, the CUDA path): it dequantizes
the weight and runs the dense matmul, so a quantized model in float32 computes exactly what a dense model
holding the dequantized weights computes; float32 always takes it (the exactness tests' dtype, as for dense
weights). In bfloat16 on CPU, torch's own int8/int4 weight-only ops read 1 or 0.5 bytes per weight where
the bf16 path reads 2 (decode at small batch is bound by those reads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .weights import FP8_MAX, Fp8Weight, Int4Weight, Int8Weight, QuantizedWeight


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
        return (isinstance(weight, Int8Weight) and device.type == "cpu" and dtype == torch.bfloat16
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
        return (isinstance(weight, Int4Weight) and device.type == "cpu" and dtype == torch.bfloat16
                and weight.group_size in (32, 64, 128, 256) and weight.shape[0] % 16 == 0)

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size,
                                                       self.scale_and_zero)
        return y if bias is None else y + bias


class CudaFp8LinearKernel:
    """`torch._scaled_mm` on FP8 tensor cores: activations quantized to e4m3 per token as they arrive, weights per
    output channel at load (row-wise scales need compute capability 9.0, H100/H200)."""

    def __init__(self, weight: Fp8Weight, dtype: torch.dtype):
        self.q_t = weight.q.t()  # column-major, as _scaled_mm wants its second operand
        self.scale = weight.scale[None, :].float()

    @staticmethod
    def supports(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        return (isinstance(weight, Fp8Weight) and device.type == "cuda" and dtype == torch.bfloat16
                and torch.cuda.get_device_capability(device) >= (9, 0)
                and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        x_scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, self.q_t, scale_a=x_scale, scale_b=self.scale, bias=bias, out_dtype=x.dtype)


def quantized_linear_kernel(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    """The fastest kernel this device has for `weight`; the reference where none applies."""
    for kernel in (CpuInt8LinearKernel, CpuInt4LinearKernel, CudaFp8LinearKernel):
        if kernel.supports(weight, dtype, device):
            return kernel(weight, dtype)
    return DequantLinearKernel(weight)

