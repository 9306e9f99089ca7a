"""The Triton w8a16 / w4a16 GEMMs (int8, int4, MXFP4: gpu_worker/engine/quantization/triton_kernels.py) against
the dequantized weight's matmul: on CUDA when there is one, else on CPU in Triton's interpreter (fp32 and fp16; it is
wrong in bf16). `TRITON_INTERPRET=1 pytest -k triton` runs exactly the Triton tests."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="Triton is not installed")

from gpu_worker.engine.quantization.triton_kernels import int4_matmul, int8_matmul, mxfp4_matmul  # noqa: E402
from gpu_worker.engine.quantization.weights import (  # noqa: E402
    Int8Weight,
    Mxfp4Weight,
    quantize_int4,
    quantize_int8,
)
from tests.kernel_inputs import seeded_weight  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if DEVICE.type == "cuda" else [])]
# (N, K): less than one tile of weight rows, several tiles with a ragged last one, K of one block and of many.
SHAPES = [(7, 32), (96, 256), (130, 128)]
ROWS = [1, 5, 17, 40]


def _assert_matches(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Against x (as given) times w in float64: fp32 summation error, plus the output's rounding in 16 bits."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    want = x.double().cpu() @ w.double().T
    err = (got.double().cpu() - want).abs()
    tol = 1e-5 * (x.double().abs().cpu() @ w.double().abs().T) + 1e-6
    if x.dtype != torch.float32:
        tol += 2 ** -7 * want.abs()
    assert (err <= tol).all(), f"max error {err.max().item():.3g} (tolerance there {tol.flatten()[err.argmax()]:.3g})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_triton_int8_per_channel_matches_the_dequantized_matmul(n, k, m, dtype):
    weight = quantize_int8(seeded_weight(n, k))
    x = torch.randn(m, k).to(dtype)
    got = int8_matmul(x.to(DEVICE), weight.q.to(DEVICE), weight.group_scale.float().contiguous().to(DEVICE))
    _assert_matches(got, x, weight.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_int8_with_a_scale_per_group_of_32_matches_the_dequantized_matmul(dtype):
    torch.manual_seed(3)
    weight = Int8Weight(torch.randint(-128, 128, (96, 256), dtype=torch.int8), torch.rand(96, 8) * 0.01,
                        group_size=32)
    x = torch.randn(5, 256).to(dtype)
    got = int8_matmul(x.to(DEVICE), weight.q.to(DEVICE), weight.group_scale.contiguous().to(DEVICE))
    _assert_matches(got, x, weight.dequantize())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k", "group_size"), [(n, k, g) for n, k in SHAPES for g in (32, 64, 128) if k % g == 0])
def test_triton_int4_matches_the_dequantized_matmul(n, k, group_size, m, dtype):
    weight = quantize_int4(seeded_weight(n, k), group_size)
    x = torch.randn(m, k).to(dtype)
    got = int4_matmul(x.to(DEVICE), weight.packed.to(DEVICE), weight.scale.float().contiguous().to(DEVICE),
                      weight.offset.float().contiguous().to(DEVICE))
    _assert_matches(got, x, weight.dequantize())


def _mxfp4(n: int, k: int) -> Mxfp4Weight:
    """Every FP4 value in every position, exponents around 2^0 (127 +- 6), as gpt-oss's experts have them."""
    gen = torch.Generator().manual_seed(n + k)
    return Mxfp4Weight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                       torch.randint(121, 134, (n, k // 32), dtype=torch.uint8, generator=gen))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_triton_mxfp4_matches_the_dequantized_matmul(n, k, m, dtype):
    weight = _mxfp4(n, k)
    x = torch.randn(m, k).to(dtype)
    got = mxfp4_matmul(x.to(DEVICE), weight.blocks.to(DEVICE), weight.scales.to(DEVICE))
    _assert_matches(got, x, weight.dequantize())


def test_cuda_serving_takes_the_triton_kernels():
    """The choice for a CUDA engine, asked wherever Triton imports (it runs no kernel)."""
    from gpu_worker.engine import EngineConfig
    from gpu_worker.engine.kernel_choice import choose_kernels
    from gpu_worker.engine.quantization.kernels import (
        TritonInt4LinearKernel,
        TritonInt8LinearKernel,
        TritonMxfp4LinearKernel,
    )

    w = seeded_weight(96, 256)
    for dtype, weight, kernel in [(torch.bfloat16, quantize_int8(w), TritonInt8LinearKernel),
                                  (torch.float16, quantize_int4(w, 64), TritonInt4LinearKernel),
                                  (torch.bfloat16, _mxfp4(96, 256), TritonMxfp4LinearKernel)]:
        linears = choose_kernels(EngineConfig("", device="cuda"), dtype).linears
        assert linears.keeps(weight)
        assert isinstance(linears.quantized(weight.to(DEVICE), shares_weight=False), kernel)


def test_mxfp4_experts_are_kept_as_stored_on_cuda_only():
    """Dequantized at load elsewhere: no CPU kernel takes MXFP4 (and the float32 reference serves dense weights)."""
    from gpu_worker.engine import EngineConfig
    from gpu_worker.engine.kernel_choice import choose_kernels

    assert not choose_kernels(EngineConfig(""), torch.bfloat16).linears.keeps(_mxfp4(96, 256))
    assert choose_kernels(EngineConfig(""), torch.bfloat16).linears.keeps(quantize_int8(seeded_weight(96, 256)))
