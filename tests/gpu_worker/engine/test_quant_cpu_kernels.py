"""The int8 / int4 kernels (kernels/quant_cpu_kernels.cpp), few-row and many-row, against the dequantized weight's
matmul (the int4 GEMV with int8 activations against the product with x quantized as it quantizes it); and the
bf16 product for CPUs without native bf16, against the float matmul."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine.kernels import QUANT_CPU_FLAGS, cpu_has, quant_cpu_kernels
from gpu_worker.engine.quantization.weights import Int8Weight, quantize_int4, quantize_int8
from tests.kernel_inputs import assert_is_product, assert_is_product_with_quantized_x, seeded_weight

# Skipped only where the CPU lacks the instructions: a failed build fails these tests.
pytestmark = pytest.mark.skipif(not cpu_has(QUANT_CPU_FLAGS), reason="the quantized CPU kernels need AVX2 + FMA + F16C")

# (N, K): one row, odd row counts, the smallest K, SmolLM2-135M's projections, a 32000 x 256 LM head.
SHAPES = [(1, 32), (7, 64), (1000, 576), (17, 1536), (32000, 256)]
GROUP_SIZES = [32, 64, 128, 256]


def _x(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k)


def _int8_gemv(x, weight):
    return quant_cpu_kernels().int8_gemv(x, weight.q, weight.group_scale)


def _int4_gemv(x, weight):
    return quant_cpu_kernels().int4_gemv_a8(x, weight.packed, weight.scale, weight.offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_matches_the_dequantized_matmul(n, k, m, dtype):
    weight = quantize_int8(seeded_weight(n, k))
    x = _x(m, k).to(dtype)
    assert_is_product(_int8_gemv(x, weight), x, weight.dequantize())


@pytest.mark.parametrize("m", [1, 3])
def test_int8_with_a_scale_per_group_of_32_matches_the_dequantized_matmul(m):
    # GGUF's Q8_0: one scale per 32 inputs.
    q = torch.randint(-127, 128, (1000, 576), dtype=torch.int8)
    weight = Int8Weight(q, torch.rand(1000, 18) * 0.01, group_size=32)
    x = _x(m, 576)
    assert_is_product(_int8_gemv(x, weight), x, weight.dequantize())


def _assert_matches_tiles(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """The many-row path multiplies x by the weight in the tiles' dtype (bf16 where the CPU multiplies bf16
    natively, float32 elsewhere), accumulating in fp32."""
    tile_dtype = getattr(torch, quant_cpu_kernels().tile_dtype())
    want = x.to(tile_dtype).double() @ w.to(tile_dtype).double().T
    scale = x.double().abs() @ w.double().abs().T
    err = (got.double() - want).abs()
    assert got.dtype == x.dtype and got.shape == want.shape
    assert (err <= 1e-5 * scale + 2 ** -8 * want.abs() + 1e-6).all(), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("m", [5, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(7, 64), (1000, 576), (17, 1536), (32000, 256)])
def test_many_rows_match_the_dequantized_matmul(n, k, m):
    w = seeded_weight(n, k)
    x = _x(m, k).bfloat16()
    int8, int4 = quantize_int8(w), quantize_int4(w, 32)
    kernels = quant_cpu_kernels()
    _assert_matches_tiles(kernels.int8_dequant_mm(x, int8.q, int8.group_scale.bfloat16()), x, int8.dequantize())
    got = kernels.int4_dequant_mm(x, int4.packed, int4.scale.bfloat16(), int4.offset.bfloat16())
    _assert_matches_tiles(got, x, int4.dequantize())


@pytest.mark.parametrize("m", [1, 3, 8, 9, 64])
@pytest.mark.parametrize(("n", "k"), [(7, 64), (1000, 576), (32000, 256)])
def test_bf16_weights_widened_to_float32_match_the_float_matmul(n, k, m):
    w = seeded_weight(n, k).bfloat16()
    for x in (_x(m, k), _x(m, k).bfloat16()):
        assert_is_product(quant_cpu_kernels().bf16_mm(x, w), x, w.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize(("n", "k", "group_size"), [(n, k, g) for n, k in SHAPES for g in GROUP_SIZES if k % g == 0])
def test_int4_gemv_with_int8_activations_is_the_product_with_x_quantized_per_run_of_32(n, k, group_size, m, dtype):
    weight = quantize_int4(seeded_weight(n, k), group_size)
    x = _x(m, k).to(dtype)
    x[0, :32] = 0  # a run of zeros: scale 0, no NaN
    assert_is_product_with_quantized_x(_int4_gemv(x, weight), x, weight.dequantize())


def test_up_to_eight_rows_and_bf16_scales():
    weight8, weight4 = quantize_int8(seeded_weight(33, 256)), quantize_int4(seeded_weight(33, 256), 64)
    x = _x(8, 256)
    # Our quantizers make scales and offsets bf16-exact, so their bf16 copies are the same weight in half the bytes.
    got = quant_cpu_kernels().int8_gemv(x, weight8.q, weight8.group_scale.bfloat16())
    assert_is_product(got, x, weight8.dequantize())
    got = quant_cpu_kernels().int4_gemv_a8(x, weight4.packed, weight4.scale.bfloat16(), weight4.offset.bfloat16())
    assert_is_product_with_quantized_x(got, x, weight4.dequantize())


def test_bf16_output_is_the_fp32_output_rounded_as_torch_rounds():
    # The same bf16-exact x in either dtype: the fp32 sums are identical, so the bf16 outputs must be torch's
    # rounding of the fp32 ones, bit for bit. The first rows' outputs are the scales themselves: two ties
    # (to even: down, then up), a negative tie and a subnormal.
    weight = quantize_int8(seeded_weight(64, 64))
    weight.q[:4] = 0
    weight.q[:4, 0] = 1
    weight.scale[:4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2.0 ** -130])
    x = _x(3, 64).bfloat16()
    x[:, 0] = 1
    got = _int8_gemv(x, weight)
    assert torch.equal(got, _int8_gemv(x.float(), weight).bfloat16())
    assert got[0, :4].tolist() == [1.0, 1 + 2 ** -6, -1.0, torch.tensor(2.0 ** -130).bfloat16().item()]
    weight4 = quantize_int4(seeded_weight(64, 64), 32)
    assert torch.equal(_int4_gemv(x, weight4), _int4_gemv(x.float(), weight4).bfloat16())


def test_bad_shapes_are_errors():
    kernels = quant_cpu_kernels()
    weight8 = quantize_int8(seeded_weight(8, 64))
    scale8 = weight8.group_scale
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.int8_gemv(torch.randn(1, 48), weight8.q[:, :48].contiguous(), scale8)
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.int8_gemv(torch.randn(1, 32), weight8.q, scale8)  # K mismatch
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.int8_gemv(torch.randn(9, 64), weight8.q, scale8)  # more than 8 rows
    with pytest.raises(RuntimeError, match="scale must be"):
        kernels.int8_gemv(torch.randn(1, 64), weight8.q, scale8[:7])
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.int8_dequant_mm(torch.randn(20, 32), weight8.q, scale8)
    weight4 = quantize_int4(seeded_weight(8, 64), 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.int4_gemv_a8(torch.randn(1, 64), weight4.packed, weight4.scale[:, :1].repeat(1, 4),
                             weight4.offset[:, :1].repeat(1, 4))  # groups of 16
    with pytest.raises(RuntimeError, match="offset must be"):
        kernels.int4_gemv_a8(torch.randn(1, 64), weight4.packed, weight4.scale, weight4.offset[:, :1])
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.int4_dequant_mm(torch.randn(9, 64), weight4.packed, weight4.scale, weight4.offset.bfloat16())
