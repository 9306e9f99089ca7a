"""Each CPU linear kernel agrees with the torch reference (`F.linear` in float32 on the same bf16 data)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.engine.linear import Linear, OneDnnPackedLinearKernel, _cpu_has_avx512_bf16, cpu_gemv_extension


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def _assert_close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: outputs may differ from an fp32 reference by its rounding, no more.
    assert ((got.float() - want).abs() <= 1e-2 * want.abs() + 1e-2 * want.abs().max()).all()


@pytest.mark.skipif(not _cpu_has_avx512_bf16(), reason="the batch-1 kernel needs AVX512-BF16")
def test_batch1_gemv_kernel_builds_and_matches_the_reference():
    ext = cpu_gemv_extension()
    assert ext is not None, "the CPU GEMV extension failed to build"
    torch.manual_seed(0)
    for n, k in [(1280, 768), (7, 64), (32000, 256)]:
        w = torch.randn(n, k, dtype=torch.bfloat16)
        x = torch.randn(1, k, dtype=torch.bfloat16)
        _assert_close_in_bf16(ext.gemv_bf16(x, w), _reference(x, w, None))


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_the_reference_for_any_row_count(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(256, 96, bias=bias).to(torch.bfloat16)
    layer.pack()
    assert isinstance(layer.kernel, OneDnnPackedLinearKernel)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        _assert_close_in_bf16(layer(x), _reference(x, layer.weight, layer.bias))


def test_float32_layers_keep_the_reference_kernel():
    layer = Linear(64, 32)
    layer.pack()
    assert not isinstance(layer.kernel, OneDnnPackedLinearKernel)
