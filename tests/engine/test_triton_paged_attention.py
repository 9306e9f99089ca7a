"""Triton paged decode attention (gpu_worker/engine/kernels/triton_paged_attention.py) against the gathering
references, over a dense, an int8 and an FP8 cache: on CUDA when there is one, else in Triton's interpreter on CPU (fp32
and fp16; it is wrong in bf16)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is defined
pytest.importorskip("triton", reason="Triton is not installed")

from gpu_worker.engine.attention import HeadLayout, TorchPagedAttention  # noqa: E402
from gpu_worker.engine.kernels.triton_paged_attention import paged_decode  # noqa: E402
from gpu_worker.engine.kv_cache_format import (  # noqa: E402
    ScaledKVCache,
    ScaledPagedAttention,
    TritonScaledPagedAttention,
)
from tests.kernel_inputs import decode_metadata  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16]
# (heads, KV heads, head_dim): GQA 3 (a padded group), none, 8.
SHAPES = [(12, 4, 64), (8, 8, 32), (16, 2, 128)]
CONTEXTS = [1, 17, 300, 64, 5, 129]  # one token, block boundaries, long
BLOCK_SIZE, NUM_BLOCKS = 16, 80


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype
    assert ((got.float().cpu() - want.float().cpu()).abs() <= tol * (1 + want.float().cpu().abs())).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_triton_decode_over_a_dense_cache_matches_the_reference(heads, kv_heads, head_dim, dtype):
    torch.manual_seed(heads)
    cache = torch.randn(2, NUM_BLOCKS, kv_heads, BLOCK_SIZE, head_dim).to(dtype)
    q = torch.randn(len(CONTEXTS), heads, head_dim).to(dtype)
    meta = decode_metadata(CONTEXTS, NUM_BLOCKS, BLOCK_SIZE)
    scale = head_dim**-0.5
    want = TorchPagedAttention(HeadLayout(heads, kv_heads, head_dim, scale)).decode(q.float(), cache.float(), meta)
    got = paged_decode(q.to(DEVICE), cache[0].to(DEVICE), cache[1].to(DEVICE), meta.decode_block_tables.to(DEVICE),
                       meta.decode_context_lens.to(DEVICE), scale)
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_triton_decode_reads_an_8_bit_cache_as_the_dequantizing_reference_does(heads, kv_heads, head_dim, dtype,
                                                                                storage):
    torch.manual_seed(heads + 1)
    shape = (2, NUM_BLOCKS, kv_heads, BLOCK_SIZE, head_dim)
    data = (torch.randint(-127, 128, shape, dtype=torch.int8) if storage == torch.int8
            else (torch.randn(shape) * 100).clamp(-448, 448).to(storage))
    scales = (torch.rand(2, NUM_BLOCKS, kv_heads, BLOCK_SIZE) * 0.05 + 1e-3).to(dtype)
    q = torch.randn(len(CONTEXTS), heads, head_dim).to(dtype)
    meta = decode_metadata(CONTEXTS, NUM_BLOCKS, BLOCK_SIZE)
    layout = HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5)
    want = ScaledPagedAttention(layout).decode(q.float(), ScaledKVCache(data, scales.float()), meta)
    cache = ScaledKVCache(data.to(DEVICE), scales.to(DEVICE))
    meta = dataclasses.replace(meta, decode_block_tables=meta.decode_block_tables.to(DEVICE),
                               decode_context_lens=meta.decode_context_lens.to(DEVICE))
    got = TritonScaledPagedAttention(layout).decode(q.to(DEVICE), cache, meta)
    _assert_close(got, want, dtype)


def test_odd_head_dims_are_refused():
    cache = torch.zeros(4, 1, 16, 48)
    with pytest.raises(ValueError, match="powers of two"):
        paged_decode(torch.zeros(1, 1, 48), cache, cache, torch.zeros(1, 1, dtype=torch.long),
                     torch.ones(1, dtype=torch.long), 1.0)
