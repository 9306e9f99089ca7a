"""How the paged KV cache stores keys and values: in the serving dtype, or as int8 / FP8 (e4m3, CUDA) with a
scale per token and head. Each format sizes a block and allocates the per-layer caches; the attention that reads
them lives in `attention.py` and its kernels' modules, picked by `kernel_choice`.

Scales are per (token, KV head), computed when the token is written, as vLLM's int8 per-token-head KV does: a
block never needs re-quantizing as it fills, and one outlier token costs only its own precision. With head_dim
64 a token-head takes 64 + 2 bytes instead of 128 in bf16, nearly twice the tokens in the same pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.text.errors import ModelLoadError

from .host_memory import zeros_streamed
from .quantization.weights import FP8_MAX

KV_CACHE_DTYPES = ("auto", "int8", "fp8")


class DenseKVFormat:
    """Keys and values in the serving dtype (`kv_cache_dtype="auto"`): one layer's cache is [2, blocks, KVH,
    block_size, D]."""

    name = "auto"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def bytes_per_block(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * self.dtype.itemsize

    def allocate(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> list[torch.Tensor]:
        # Head-major within a block: one head's rows of a block are contiguous, so a decode kernel streams them.
        shape = (2, num_blocks, num_kv_heads, block_size, head_dim)
        return [zeros_streamed(shape, self.dtype, device) for _ in range(num_layers)]


@dataclass
class ScaledKVCache:
    """One layer's cache: int8 or fp8 values [2, blocks, KVH, block_size, D], their scales [2, blocks, KVH,
    block_size] in the serving dtype."""

    data: torch.Tensor
    scale: torch.Tensor


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], scale [...] in x's dtype) with x ~ q * scale, symmetric per row."""
    scale = (x.float().abs().amax(dim=-1) / 127).clamp(min=1e-8).to(x.dtype)
    q = torch.round(x.float() / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_per_row_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn [..., D], scale [...] in x's dtype): each row's max |x| maps to e4m3's 448."""
    scale = (x.float().abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-8).to(x.dtype)
    q = (x.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class ScaledKVFormat:
    """Values at 8 bits with a scale per token and head: int8 (`kv_cache_dtype="int8"`, CPU and CUDA) or FP8 e4m3
    (`"fp8"`, CUDA)."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name = name
        self.dtype = dtype  # of the scales, and of what attention computes in
        self.storage = torch.int8 if name == "int8" else torch.float8_e4m3fn
        self.quantize = quantize_per_row if name == "int8" else quantize_per_row_fp8

    def bytes_per_block(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * (head_dim + self.dtype.itemsize)

    def allocate(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> list:
        return [ScaledKVCache(zeros_streamed((2, num_blocks, num_kv_heads, block_size, head_dim), self.storage, device),
                              zeros_streamed((2, num_blocks, num_kv_heads, block_size), self.dtype, device))
                for _ in range(num_layers)]


KVCacheFormat = DenseKVFormat | ScaledKVFormat


def kv_cache_format(name: str, dtype: torch.dtype, device: torch.device) -> KVCacheFormat:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    if name == "fp8" and device.type != "cuda":
        raise ModelLoadError("an fp8 KV cache needs a CUDA GPU; on CPU use kv_cache_dtype='int8'")
    return DenseKVFormat(dtype) if name == "auto" else ScaledKVFormat(name, dtype)
