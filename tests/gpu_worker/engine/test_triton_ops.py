"""The Triton element-wise ops (gpu_worker/engine/kernels/triton_ops.py) against the torch references in
gpu_worker/engine/ops.py: on CUDA when there is one, else in Triton's interpreter on CPU (fp32 and fp16)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="Triton is not installed")

from gpu_worker.engine import ops  # noqa: E402
from gpu_worker.engine.kernels import triton_ops  # noqa: E402
from gpu_worker.engine.rope import RotaryEmbedding  # noqa: E402
from tests.kernel_inputs import decode_metadata  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16]


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # fp16: the kernels round once where the references may round twice (one fp16 ulp is 2^-10 of a value).
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype and got.shape == want.shape
    assert ((got.float().cpu() - want.float().cpu()).abs() <= tol * (1 + want.float().cpu().abs())).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_triton_rms_norm_matches_the_reference(hidden, dtype):
    torch.manual_seed(hidden)
    x, weight = torch.randn(5, hidden).to(dtype), (torch.rand(hidden) + 0.5).to(dtype)
    normed, summed = triton_ops.rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6)
    _assert_close(normed, ops.rms_norm_reference(x, weight, 1e-6), dtype)
    assert torch.equal(summed.cpu(), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_triton_add_rms_norm_matches_the_reference(hidden, dtype):
    torch.manual_seed(hidden + 1)
    x, residual = torch.randn(7, hidden).to(dtype), torch.randn(7, hidden).to(dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    normed, summed = triton_ops.rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-5, residual.to(DEVICE))
    want_normed, want_summed = ops.add_rms_norm_reference(x, residual, weight, 1e-5)
    _assert_close(normed, want_normed, dtype)
    _assert_close(summed, want_summed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [128, 1536, 14336])
def test_triton_silu_and_mul_matches_the_reference(intermediate, dtype):
    torch.manual_seed(intermediate)
    x = (torch.randn(3, 2 * intermediate) * 4).to(dtype)
    _assert_close(triton_ops.silu_and_mul(x.to(DEVICE)), ops.silu_and_mul_reference(x), dtype)


def _rotary_inputs(tokens, heads, kv_heads, head_dim, dtype):
    torch.manual_seed(heads * head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, 4000, (tokens,))
    cos, sin = RotaryEmbedding(head_dim, 500000.0, {}).cos_sin(positions, dtype)
    return qkv, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (8, 1, 128), (2, 2, 80)])
def test_triton_rotary_matches_the_reference(heads, kv_heads, head_dim, dtype):
    qkv, cos, sin = _rotary_inputs(6, heads, kv_heads, head_dim, dtype)
    want = qkv.clone()
    ops.rotary_reference_(want, cos, sin, heads + kv_heads, head_dim)
    got = qkv.to(DEVICE)
    triton_ops.rotary_(got, cos.to(DEVICE), sin.to(DEVICE), heads + kv_heads, head_dim)
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (8, 1, 128)])
def test_triton_rotary_writes_each_tokens_keys_and_values_into_its_slot(heads, kv_heads, head_dim, dtype):
    tokens, block_size, num_blocks = 5, 16, 12
    qkv, cos, sin = _rotary_inputs(tokens, heads, kv_heads, head_dim, dtype)
    meta = decode_metadata([1, 17, 40, 16, 3], num_blocks, block_size)
    want_qkv = qkv.clone()
    ops.rotary_reference_(want_qkv, cos, sin, heads + kv_heads, head_dim)
    _, want_k, want_v = (want_qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    want_cache = torch.zeros(2, num_blocks, kv_heads, block_size, head_dim, dtype=dtype)
    want_cache[0][meta.slot_blocks, :, meta.slot_offsets] = want_k.reshape(tokens, kv_heads, head_dim)
    want_cache[1][meta.slot_blocks, :, meta.slot_offsets] = want_v.reshape(tokens, kv_heads, head_dim)
    got_qkv, got_cache = qkv.to(DEVICE), torch.zeros_like(want_cache, device=DEVICE)
    triton_ops.rotary_and_write_kv_(got_qkv, cos.to(DEVICE), sin.to(DEVICE), heads, kv_heads, head_dim, got_cache,
                                    meta.slot_blocks.to(DEVICE), meta.slot_offsets.to(DEVICE))
    _assert_close(got_qkv, want_qkv, dtype)
    _assert_close(got_cache, want_cache, dtype)
