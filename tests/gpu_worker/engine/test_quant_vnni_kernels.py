"""The int8 / int4 products with int8 activations, the GEMVs for few rows (kernels/quant_vnni_kernels.cpp) and the
GEMM for many (kernels/quant_vnni_gemm.cpp): exactly the weight times x quantized per run of 32 inputs (up to fp32
summation), which is within a run's rounding of x itself."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine.kernels import QUANT_VNNI_FLAGS, cpu_has, quant_vnni_kernels
from gpu_worker.engine.quantization.weights import Int8Weight, quantize_int4, quantize_int8
from tests.kernel_inputs import assert_is_product_with_quantized_x, seeded_weight

# Skipped only where the CPU lacks the instructions: a failed build fails these tests.
pytestmark = pytest.mark.skipif(not cpu_has(QUANT_VNNI_FLAGS), reason="the int8-activation kernels need AVX512-VNNI")

# (N, K): K of one run, of one chunk and a half (zero padding), SmolLM2-135M's projections, a 32000-row LM head.
SHAPES = [(5, 32), (33, 96), (1000, 576), (17, 1536), (32000, 256)]


def _int8(x, weight, kernel="gemv"):
    return getattr(quant_vnni_kernels(), f"int8_{kernel}_a8")(x, weight.q, weight.group_scale)


def _int4(x, weight, kernel="gemv"):
    return getattr(quant_vnni_kernels(), f"int4_{kernel}_a8")(x, weight.packed, weight.scale, weight.offset)


# (kernel, rows): the GEMM takes x's rows 8 at a time against each block of 16 weight rows, the last group shorter.
KERNEL_ROWS = [("gemv", 1), ("gemv", 2), ("gemv", 3), ("gemv", 8), ("gemm", 1), ("gemm", 5), ("gemm", 17)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kernel", "m"), KERNEL_ROWS)
@pytest.mark.parametrize(("n", "k"), [s for s in SHAPES if s[1] % 64 == 0 or s[1] == 32])
def test_int8_per_channel_is_the_product_with_x_quantized_per_run_of_32(n, k, kernel, m, dtype):
    weight = quantize_int8(seeded_weight(n, k))
    x = torch.randn(m, k).to(dtype)
    assert_is_product_with_quantized_x(_int8(x, weight, kernel), x, weight.dequantize())


@pytest.mark.parametrize(("kernel", "m"), [("gemv", 1), ("gemv", 4), ("gemm", 3), ("gemm", 12)])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_with_a_scale_per_group_of_32_is_the_product_with_quantized_x(n, k, kernel, m):
    # GGUF's Q8_0, signed weights down to -128 included.
    torch.manual_seed(k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    weight = Int8Weight(q, torch.rand(n, k // 32) * 0.01, group_size=32)
    x = torch.randn(m, k)
    assert_is_product_with_quantized_x(_int8(x, weight, kernel), x, weight.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kernel", "m"), [kr for kr in KERNEL_ROWS if kr[1] != 2])
@pytest.mark.parametrize(("n", "k", "group_size"),
                         [(n, k, g) for n, k in SHAPES for g in (32, 64, 128, 192) if k % g == 0])
def test_int4_is_the_product_with_x_quantized_per_run_of_32(n, k, group_size, kernel, m, dtype):
    weight = quantize_int4(seeded_weight(n, k), group_size)
    x = torch.randn(m, k).to(dtype)
    assert_is_product_with_quantized_x(_int4(x, weight, kernel), x, weight.dequantize())


@pytest.mark.parametrize("kernel", ["gemv", "gemm"])
@pytest.mark.parametrize("m", [9, 17, 40])
def test_many_rows_take_groups_of_eight_and_the_rest(kernel, m):
    # A decode batch: rows in groups of 8 against each pass (GEMV) or block (GEMM) of weight rows, the last group
    # shorter.
    weight8, weight4 = quantize_int8(seeded_weight(1000, 576)), quantize_int4(seeded_weight(1000, 576), 32)
    x = torch.randn(m, 576).bfloat16()
    assert_is_product_with_quantized_x(_int8(x, weight8, kernel), x, weight8.dequantize())
    assert_is_product_with_quantized_x(_int4(x, weight4, kernel), x, weight4.dequantize())


def test_the_gemm_takes_any_group_size_of_whole_runs():
    # The GEMVs' chunks of 64 inputs need groups of 32 or multiples of 64; the GEMM's runs of 32 take 96.
    weight8 = quantize_int8(seeded_weight(40, 192))
    weight4 = quantize_int4(seeded_weight(40, 192), 96)
    x = torch.randn(11, 192)
    assert_is_product_with_quantized_x(_int8(x, weight8, "gemm"), x, weight8.dequantize())
    assert_is_product_with_quantized_x(_int4(x, weight4, "gemm"), x, weight4.dequantize())


def test_quantizing_x_per_run_costs_about_half_a_percent():
    # The run scales bound each input's error by half a step of its run's max / 127.
    weight = quantize_int4(seeded_weight(1000, 576), 64)
    x = torch.randn(4, 576)
    exact = x @ weight.dequantize().T
    rel = ((_int4(x, weight) - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.01


@pytest.mark.parametrize("kernel", ["gemv", "gemm"])
def test_zero_runs_of_x_give_zero_and_not_nan(kernel):
    weight = quantize_int8(seeded_weight(64, 128))
    x = torch.zeros(2, 128)
    x[1, 64:] = torch.randn(64)
    got = _int8(x, weight, kernel)
    assert not got.isnan().any() and (got[0] == 0).all()
    assert_is_product_with_quantized_x(got, x, weight.dequantize())


@pytest.mark.parametrize("kernel", ["gemv", "gemm"])
def test_bf16_output_is_the_fp32_output_rounded(kernel):
    weight = quantize_int4(seeded_weight(256, 576), 32)
    x = torch.randn(3, 576).bfloat16()
    assert torch.equal(_int4(x, weight, kernel), _int4(x.float(), weight, kernel).bfloat16())


def test_bad_shapes_are_errors():
    kernels = quant_vnni_kernels()
    weight = quantize_int8(seeded_weight(8, 96))
    with pytest.raises(RuntimeError, match="32 or a multiple of 64"):
        kernels.int8_gemv_a8(torch.randn(1, 96), weight.q, weight.group_scale)  # one group of 96
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.int8_gemv_a8(torch.randn(2, 64), weight.q, weight.scale[:, None].repeat(1, 3))  # K mismatch
    weight4 = quantize_int4(seeded_weight(8, 64), 32)
    with pytest.raises(RuntimeError, match="offset must be"):
        kernels.int4_gemv_a8(torch.randn(1, 64), weight4.packed, weight4.scale, weight4.offset[:, :1])
