"""The int8 / int4 products for a decode batch's tens of rows on AMX (kernels/quant_amx_kernels.cpp), against the
dequantized weight's matmul."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine.kernels import QUANT_AMX_FLAGS, cpu_has, quant_amx_kernels
from gpu_worker.engine.quantization.weights import Int8Weight, quantize_int4, quantize_int8
from tests.kernel_inputs import assert_is_product, seeded_weight

# Skipped only where the CPU lacks AMX: a failed build (or Linux refusing the tiles) fails these tests.
pytestmark = pytest.mark.skipif(not cpu_has(QUANT_AMX_FLAGS), reason="the AMX kernels need AMX-BF16")

# (N, K): one tile of weight rows and less, odd block counts, SmolLM2-135M's projections, a 32000-row LM head.
SHAPES = [(7, 64), (33, 96), (1000, 576), (17, 1536), (32000, 256)]
ROWS = [1, 13, 16, 17, 40, 64]


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_per_channel_is_the_exact_weight_times_x(n, k, m):
    # Per channel the kernel multiplies the integers and scales the sums: the weight is exact, not rounded to bf16.
    weight = quantize_int8(seeded_weight(n, k))
    x = torch.randn(m, k).bfloat16()
    assert_is_product(quant_amx_kernels().int8_amx_mm(x, weight.q, weight.group_scale), x, weight.dequantize())


@pytest.mark.parametrize("m", [5, 40])
def test_int8_with_a_scale_per_group_of_32_matches_its_bf16_dequantization(m):
    torch.manual_seed(m)
    weight = Int8Weight(torch.randint(-128, 128, (1000, 576), dtype=torch.int8), torch.rand(1000, 18) * 0.01,
                        group_size=32)
    x = torch.randn(m, 576).bfloat16()
    got = quant_amx_kernels().int8_amx_mm(x, weight.q, weight.group_scale)
    assert_is_product(got, x, weight.dequantize().bfloat16().float())


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k", "group_size"),
                         [(n, k, g) for n, k in SHAPES for g in (32, 64, 128) if k % g == 0])
def test_int4_matches_its_bf16_dequantization(n, k, group_size, m):
    weight = quantize_int4(seeded_weight(n, k), group_size)
    x = torch.randn(m, k).bfloat16()
    got = quant_amx_kernels().int4_amx_mm(x, weight.packed, weight.scale.bfloat16(), weight.offset.bfloat16())
    assert_is_product(got, x, weight.dequantize().bfloat16().float())


def test_float32_x_gives_float32_y():
    weight = quantize_int8(seeded_weight(64, 128))
    x = torch.randn(20, 128)
    got = quant_amx_kernels().int8_amx_mm(x, weight.q, weight.group_scale)
    assert got.dtype == torch.float32
    assert torch.equal(got, quant_amx_kernels().int8_amx_mm(x.bfloat16(), weight.q, weight.group_scale).float())


def test_bad_shapes_are_errors():
    kernels = quant_amx_kernels()
    weight = quantize_int8(seeded_weight(8, 64))
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.int8_amx_mm(torch.randn(20, 32), weight.q, weight.group_scale)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.int8_amx_mm(torch.randn(20, 48), weight.q[:, :48].contiguous(), weight.group_scale)
    weight4 = quantize_int4(seeded_weight(8, 64), 32)
    with pytest.raises(RuntimeError, match="offset must be"):
        kernels.int4_amx_mm(torch.randn(20, 64), weight4.packed, weight4.scale, weight4.offset[:, :1])
