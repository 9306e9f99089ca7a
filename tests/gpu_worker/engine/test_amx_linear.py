"""The bf16 matmul for a decode step's rows on AMX (kernels/amx_linear.cpp), reading the weight oneDNN packed for
itself: against the weight's matmul in float64, and behind `OneDnnPackedLinearKernel`."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import linear
from gpu_worker.engine.kernels import AMX_BF16_FLAGS, cpu_has, cpu_kernels
from gpu_worker.engine.linear import AMX_LINEAR_ROWS, GEMV_ROWS, GemvPlan, OneDnnPackedLinearKernel, amx_tiles
from tests.kernel_inputs import assert_is_product, seeded_weight

# Skipped only where the CPU lacks AMX: a failed build, Linux refusing the tiles or oneDNN packing the weight in
# another layout fails these tests.
pytestmark = pytest.mark.skipif(not cpu_has(AMX_BF16_FLAGS), reason="the AMX matmul needs AMX-BF16")

# (N, K): less than one 32-column block, a block and a half, tokenfleet-large's projections, a 32000-row LM head.
SHAPES = [(7, 64), (48, 96), (1280, 768), (768, 2048), (32000, 256)]
# One row, a row tile and one over, past one 256-input chunk's pair of row tiles, the most rows it serves.
ROWS = [1, 16, 17, 40, 113, AMX_LINEAR_ROWS]


def _packed(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, linear.PACKING_BATCH_HINT)
    tiles = amx_tiles(packed, weight, cpu_kernels())
    assert tiles is not None, "oneDNN's packed weight is not in the layout the AMX matmul reads"
    return packed, tiles


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_amx_matmul_over_onednns_packed_weight_is_the_weight_times_x(n, k, m):
    weight = seeded_weight(n, k).bfloat16()
    packed, tiles = _packed(weight)
    x = torch.randn(m, k).bfloat16()
    assert_is_product(cpu_kernels().amx_linear_bf16(x, tiles, n, None), x, weight)


@pytest.mark.parametrize(("n", "k"), [(48, 96), (1280, 768)])
def test_amx_matmul_adds_the_bias_before_rounding(n, k):
    weight, bias = seeded_weight(n, k).bfloat16(), torch.randn(n).bfloat16()
    packed, tiles = _packed(weight)
    x = torch.randn(40, k).bfloat16()
    assert_is_product(cpu_kernels().amx_linear_bf16(x, tiles, n, bias), x, weight, bias)


def test_amx_tiles_refuse_a_packed_weight_in_another_layout():
    weight = seeded_weight(64, 96).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, linear.PACKING_BATCH_HINT)
    assert amx_tiles(packed, weight, cpu_kernels()) is not None
    # The same bytes checked against another weight: what a layout oneDNN chose differently would look like.
    assert amx_tiles(packed, weight.flip(0), cpu_kernels()) is None


def test_amx_matmul_rejects_inputs_not_in_steps_of_32():
    weight = seeded_weight(64, 96).bfloat16()
    _, tiles = _packed(weight)
    with pytest.raises(RuntimeError, match="K % 32"):
        cpu_kernels().amx_linear_bf16(torch.randn(4, 80).bfloat16(), tiles, 64, None)


@pytest.mark.parametrize("m", [GEMV_ROWS + 1, AMX_LINEAR_ROWS, AMX_LINEAR_ROWS + 1])
def test_packed_linear_serves_every_row_count_the_same_within_rounding(m, monkeypatch):
    # Up to AMX_LINEAR_ROWS rows the tiles serve; past it oneDNN: both the weight times x.
    weight = seeded_weight(1280, 768).bfloat16()
    kernel = OneDnnPackedLinearKernel(weight, cpu_kernels(), GemvPlan())
    assert kernel.tiles is not None
    x = torch.randn(m, 768).bfloat16()
    calls = []
    monkeypatch.setattr(kernel, "native", _Counting(kernel.native, calls))
    assert_is_product(kernel(x, weight, None), x, weight)
    assert calls == (["amx_linear_bf16"] if m <= AMX_LINEAR_ROWS else [])


class _Counting:
    """The real kernels module, noting which of its matmuls were called."""

    def __init__(self, module, calls: list):
        self.module, self.calls = module, calls

    def __getattr__(self, name):
        if name in ("amx_linear_bf16", "gemv_bf16"):
            self.calls.append(name)
        return getattr(self.module, name)
