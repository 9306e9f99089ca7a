"""Linear kernels for quantized weights, plugged in behind `Linear`'s kernel interface; `kernel_choice` picks one
per weight.

`DequantLinearKernel` is the reference: it dequantizes the weight and runs the dense matmul, so a quantized
model in float32 computes exactly what a dense model holding the dequantized weights computes; float32 always
takes it (the exactness tests' dtype, as for dense weights). In bfloat16 on CPU our native kernels read 1 or 0.5
bytes per weight where the bf16 path reads 2 (decode at small batch is bound by those reads); on CUDA, Triton's
w8a16 / w4a16 GEMMs and FP8's `_scaled_mm`. The row counts each CPU kernel serves are where it measured faster
than the next (`tokenfleet bench quant`; bench/RESULTS.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..host_memory import move_to_huge_pages_
from .weights import FP8_MAX, Fp8Weight, Int4Weight, Int8Weight, Mxfp4Weight, QuantizedWeight, exact_scales

# Rows up to which the native GEMVs beat dequantized tiles (they stream the weight once for all of them, but their
# arithmetic grows with the rows where oneDNN's AMX barely notices): the AVX2 ones up to GEMV_ROWS, the VNNI ones
# beside AMX up to VNNI_INT8_ROWS / VNNI_INT4_ROWS; where the VNNI GEMM follows instead of AMX, up to GEMV_ROWS.
GEMV_ROWS = 4
VNNI_INT8_ROWS = 12
VNNI_INT4_ROWS = 8
# Rows up to which AMX over blocks of dequantized weight rows kept in cache beats the tiles into oneDNN.
AMX_ROWS = 64
# The row count oneDNN tunes a prepacked int8 layout for; it serves every row count.
PACKING_BATCH_HINT = 128


class DequantLinearKernel:
    def __init__(self, weight: QuantizedWeight):
        self.weight = weight

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize().to(x.dtype), bias)


class OneDnnInt8LinearKernel:
    """w8a8: int8 x int8 on oneDNN (AMX-INT8 / AVX512-VNNI), activations quantized per token as they arrive
    (symmetric, max |x| / 127, as vLLM's dynamic W8A8), the weight prepacked once in oneDNN's layout, the only
    copy kept (so never for a weight the embedding table shares). Faster than bf16 for many rows, but it costs
    more perplexity than weight-only int8 (`tokenfleet bench quant`), so it is its own method, `w8a8`."""

    def __init__(self, weight: Int8Weight, native):
        n, k = weight.shape
        self.packed = torch.ops.onednn.qlinear_prepack(weight.q.contiguous(), [PACKING_BATCH_HINT, k])
        self.weight_scale = weight.scale.float().contiguous()
        self.zero_points = torch.zeros(n, dtype=torch.int64)
        self.native = native.quant

    @staticmethod
    def takes(weight: QuantizedWeight) -> bool:
        return isinstance(weight, Int8Weight) and weight.int8_activations

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        xq, x_scale = self.native.quantize_rows(x)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, self.packed, self.weight_scale, self.zero_points, None,
                                               1.0, 0, torch.float32, "none", [], "")
        y = (y * x_scale).to(x.dtype)
        return y if bias is None else y + bias


@functools.cache
def onednn_int8_matmul() -> bool:
    """Whether this torch's oneDNN multiplies int8 x int8 exactly here. With VNNI or AMX it does; on plain AVX2
    its kernels add 128 to the activations and multiply pairs into saturating 16-bit sums (vpmaddubsw), which
    overflow, so there w8a8 falls to the weight-only kernels."""
    x = torch.full((1, 32), 127, dtype=torch.int8)
    w = torch.full((32, 32), 127, dtype=torch.int8)
    try:
        packed = torch.ops.onednn.qlinear_prepack(w, [1, 32])
        y = torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, packed, torch.ones(32), torch.zeros(32, dtype=torch.int64),
                                               None, 1.0, 0, torch.float32, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool((y == 32 * 127 * 127).all())


def few_row_gemvs(group_size: int, native) -> tuple[tuple[Callable, int], tuple[Callable, int]]:
    """The int8 and int4 GEMVs that serve a decode step's few rows for weights in groups of `group_size`, each
    with the most rows it serves, from `native` (`kernels.NativeKernels`): the int8-activation ones
    (`kernels/quant_vnni_kernels.cpp`) where the CPU has VNNI and they take the group size; else
    (`kernels/quant_cpu_kernels.cpp`) the fp32 int8 GEMV and the int4 one with int8 activations
    (`kernels/quant_avx2_gemv.cpp`)."""
    vnni = native.quant_vnni
    if vnni is not None and (group_size == 32 or group_size % 64 == 0):
        if native.quant_amx is None:  # the VNNI GEMM takes over from 5 rows
            return (vnni.int8_gemv_a8, GEMV_ROWS), (vnni.int4_gemv_a8, GEMV_ROWS)
        return (vnni.int8_gemv_a8, VNNI_INT8_ROWS), (vnni.int4_gemv_a8, VNNI_INT4_ROWS)
    return (native.quant.int8_gemv, GEMV_ROWS), (native.quant.int4_gemv_a8, GEMV_ROWS)


class _NativeCpuKernel:
    """Our kernels for x [M, K] bf16, by row count: `gemv`, streaming the weight once, for the few rows of a
    decode step; then, where the CPU has AMX, `amx` (blocks of dequantized weight rows kept in cache,
    `kernels/quant_amx_kernels.cpp`) for a decode batch's tens of rows and `tiles` (dequantized bf16 tiles into
    oneDNN, `kernels/quant_cpu_kernels.cpp`) for more; where it has VNNI and no AMX, `gemm` (int8 activations,
    `kernels/quant_vnni_gemm.cpp`) for every larger row count, where it beats the tiles; else the tiles. `native`:
    the CPU's modules (`kernels.NativeKernels`)."""

    def __init__(self, gemv: tuple[Callable, int], native):
        self.native = native.quant
        self._gemv, self.gemv_rows = gemv
        self.amx_kernels, self.vnni_kernels = native.quant_amx, native.quant_vnni
        if self.amx_kernels is not None:
            self.larger, self.larger_rows = self.amx, AMX_ROWS
        elif self.vnni_kernels is not None:
            self.larger, self.larger_rows = self.gemm, math.inf
        else:
            self.larger, self.larger_rows = self.tiles, math.inf

    def gemv(self, x: torch.Tensor) -> torch.Tensor: ...

    def amx(self, x: torch.Tensor) -> torch.Tensor: ...

    def gemm(self, x: torch.Tensor) -> torch.Tensor: ...

    def tiles(self, x: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.gemv_rows:
            y = self.gemv(x.contiguous())
        elif rows <= self.larger_rows:
            y = self.larger(x)
        else:
            y = self.tiles(x)
        return y if bias is None else y + bias

    def float32_output(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The product in float32 (the GEMV's own accumulator) for the few rows of a decode step: logits that
        keep the near-ties bf16 rounding would break (bf16 steps are 0.125 at logit 16)."""
        if x.shape[0] > self.gemv_rows:
            return self(x, None, bias).float()
        return self(x.float(), None, None if bias is None else bias.float())


class CpuInt8LinearKernel(_NativeCpuKernel):
    """int8 [N, K] with per-channel or per-group scales."""

    def __init__(self, weight: Int8Weight, native):
        self.q = weight.q.contiguous()
        move_to_huge_pages_(self.q)
        self.scale = exact_scales(weight.group_scale)
        super().__init__(few_row_gemvs(weight.shape[1] // self.scale.shape[1], native)[0], native)

    @staticmethod
    def takes(weight: QuantizedWeight) -> bool:
        return isinstance(weight, Int8Weight) and (weight.shape[1] // weight.group_scale.shape[1]) % 32 == 0

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemv(x, self.q, self.scale)

    def amx(self, x: torch.Tensor) -> torch.Tensor:
        return self.amx_kernels.int8_amx_mm(x, self.q, self.scale)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        return self.vnni_kernels.int8_gemm_a8(x, self.q, self.scale)

    def tiles(self, x: torch.Tensor) -> torch.Tensor:
        return self.native.int8_dequant_mm(x, self.q, self.scale)


class CpuInt4LinearKernel(_NativeCpuKernel):
    """int4 [N, K] in groups; an act-order weight's inputs are permuted as they arrive."""

    def __init__(self, weight: Int4Weight, native):
        self.input_perm = weight.input_perm
        self.packed = weight.packed.contiguous()
        move_to_huge_pages_(self.packed)
        self.scale, self.offset = exact_scales(weight.scale, weight.offset)
        super().__init__(few_row_gemvs(weight.group_size, native)[1], native)

    @staticmethod
    def takes(weight: QuantizedWeight) -> bool:
        return isinstance(weight, Int4Weight) and weight.group_size % 32 == 0

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        return super().__call__(x, _dense, bias)

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemv(x, self.packed, self.scale, self.offset)

    def amx(self, x: torch.Tensor) -> torch.Tensor:
        return self.amx_kernels.int4_amx_mm(x, self.packed, self.scale, self.offset)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        return self.vnni_kernels.int4_gemm_a8(x, self.packed, self.scale, self.offset)

    def tiles(self, x: torch.Tensor) -> torch.Tensor:
        return self.native.int4_dequant_mm(x, self.packed, self.scale, self.offset)


class _TritonLinearKernel:
    """w8a16 / w4a16 (int4 or MXFP4) on CUDA by `triton_kernels.py`, the weight dequantized in registers (groups of
    32 or more): `matmul` of x as rows [M, K]; an act-order weight's inputs are permuted as they arrive."""

    input_perm: torch.Tensor | None = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        y = self.matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class TritonInt8LinearKernel(_TritonLinearKernel):
    def __init__(self, weight: Int8Weight):
        from . import triton_kernels

        self.kernel = triton_kernels.int8_matmul
        self.q = weight.q.contiguous()
        self.scale = weight.group_scale.float().contiguous()

    takes = staticmethod(CpuInt8LinearKernel.takes)  # groups of 32 inputs or more

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.q, self.scale)


class TritonInt4LinearKernel(_TritonLinearKernel):
    def __init__(self, weight: Int4Weight):
        from . import triton_kernels

        self.kernel = triton_kernels.int4_matmul
        self.input_perm = weight.input_perm
        self.packed = weight.packed.contiguous()
        self.scale, self.offset = weight.scale.float().contiguous(), weight.offset.float().contiguous()

    takes = staticmethod(CpuInt4LinearKernel.takes)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.packed, self.scale, self.offset)


class TritonMxfp4LinearKernel(_TritonLinearKernel):
    def __init__(self, weight: Mxfp4Weight):
        from . import triton_kernels

        self.kernel = triton_kernels.mxfp4_matmul
        self.blocks, self.scales = weight.blocks.contiguous(), weight.scales.contiguous()

    @staticmethod
    def takes(weight: QuantizedWeight) -> bool:
        return isinstance(weight, Mxfp4Weight)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.blocks, self.scales)


class CudaFp8LinearKernel:
    """`torch._scaled_mm` on FP8 tensor cores: activations quantized to e4m3 per token as they arrive, weights per
    output channel at load (row-wise scales need compute capability 9.0, H100/H200)."""

    def __init__(self, weight: Fp8Weight):
        self.q_t = weight.q.t()  # column-major, as _scaled_mm wants its second operand
        self.scale = weight.scale[None, :].float()

    @staticmethod
    def takes(weight: QuantizedWeight) -> bool:
        """An FP8 weight of a shape the tensor cores take, on a GPU with row-wise FP8 matmuls."""
        return (isinstance(weight, Fp8Weight) and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
                and torch.cuda.get_device_capability(weight.q.device) >= (9, 0))

    def __call__(self, x: torch.Tensor, _dense: None, bias: torch.Tensor | None) -> torch.Tensor:
        x_scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, self.q_t, scale_a=x_scale, scale_b=self.scale, bias=bias, out_dtype=x.dtype)
