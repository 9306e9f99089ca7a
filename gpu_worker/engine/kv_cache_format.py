"""How the paged KV cache stores keys and values: in the serving dtype, or as int8 / FP8 (e4m3, CUDA) with a
scale per token and head. Each format sizes a block, allocates the per-layer caches and installs the attention
that reads them.

Scales are per (token, KV head), computed when the token is written, as vLLM's int8 per-token-head KV does: a
block never needs re-quantizing as it fills, and one outlier token costs only its own precision. With head_dim
64 a token-head takes 64 + 2 bytes instead of 128 in bf16: 1.94x the tokens in the same pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import (
    CpuPagedAttention,
    HeadLayout,
    NativePrefillAttention,
    TorchPagedAttention,
    TritonPagedAttention,
    WidenedDecodeAttention,
    _gather,
    allocate_kv_cache,
    decode_step_arguments,
    triton_attend,
)
from .errors import ModelLoadError
from .host_memory import zeros_streamed
from .kernels import bf16_kernels, triton_available
from .model import Transformer
from .quantization.weights import FP8_MAX

KV_CACHE_DTYPES = ("auto", "int8", "fp8")


class DenseKVFormat:
    """Keys and values in the serving dtype (`kv_cache_dtype="auto"`)."""

    name = "auto"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def bytes_per_block(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * self.dtype.itemsize

    def allocate(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> list:
        return allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, self.dtype, device)

    def install(self, model: Transformer, device: torch.device) -> None:
        """The native CPU attention where it applies (bf16 on CPU, by the AVX-512 kernels or the AVX2 ones; its
        prefill on AMX tiles where the CPU has them), else on CPU in bf16 the torch path with its decode in float32;
        Triton's on CUDA; the torch reference elsewhere."""
        bf16_on_cpu = device.type == "cpu" and self.dtype == torch.bfloat16
        kernels = bf16_kernels() if bf16_on_cpu else None
        for layer in model.layers:
            heads = layer.self_attn.attn.heads
            if NativePrefillAttention.supports(kernels, self.dtype, device, model.config.head_dim):
                layer.self_attn.attn = NativePrefillAttention(heads, kernels)
            elif CpuPagedAttention.supports(kernels, self.dtype, device, model.config.head_dim):
                layer.self_attn.attn = CpuPagedAttention(heads, kernels)
            elif bf16_on_cpu:
                layer.self_attn.attn = WidenedDecodeAttention(heads)
            elif device.type == "cuda" and triton_available():
                layer.self_attn.attn = TritonPagedAttention(heads)


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


class ScaledPagedAttention(TorchPagedAttention):
    """The torch reference over an int8 / fp8 cache: quantize on write, dequantize what a step gathers."""

    def __init__(self, heads: HeadLayout, quantize=quantize_per_row):
        super().__init__(heads)
        self.quantize = quantize

    def write_kv(self, k, v, kv_cache: ScaledKVCache, meta) -> None:
        for i, x in enumerate((k, v)):
            q, scale = self.quantize(x)
            kv_cache.data[i][meta.slot_blocks, :, meta.slot_offsets] = q
            kv_cache.scale[i][meta.slot_blocks, :, meta.slot_offsets] = scale

    def gather(self, kv_cache: ScaledKVCache, block_tables: torch.Tensor, length: int):
        return tuple(_gather(kv_cache.data[i], block_tables, length).to(kv_cache.scale.dtype)
                     * _gather(kv_cache.scale[i][..., None], block_tables, length) for i in (0, 1))


class CpuInt8PagedAttention(ScaledPagedAttention):
    """KV writes and decode attention by the native kernels (AVX-512's or AVX2's) on the int8 cache itself (bf16 on
    CPU): keys and values dequantized in registers, where the reference gathers a dequantized copy of every
    context; a decode-only step's rotary, write and attention in one native call. Prefill over a cached context
    attends over such a copy, gathered and dequantized in one pass."""

    row_invariant_decode = True  # one task per (row, KV head), over exactly the row's context

    def __init__(self, heads: HeadLayout, kernels):
        super().__init__(heads)
        self.kernels = kernels

    def __call__(self, qkv, cos, sin, kv_cache: ScaledKVCache, meta) -> torch.Tensor:
        if meta.prefills:
            return super().__call__(qkv, cos, sin, kv_cache, meta)
        return self.kernels.decode_step_int8(qkv, cos, sin, kv_cache.data, kv_cache.scale,
                                             *decode_step_arguments(meta, self.heads))

    def write_kv(self, k, v, kv_cache: ScaledKVCache, meta) -> None:
        self.kernels.write_kv_int8(k, v, kv_cache.data, kv_cache.scale, meta.slot_blocks, meta.slot_offsets)

    def gather(self, kv_cache: ScaledKVCache, block_tables: torch.Tensor, length: int):
        return tuple(self.kernels.gather_int8_bf16(kv_cache.data, kv_cache.scale, i, block_tables, length)
                     for i in (0, 1))

    def decode(self, q, kv_cache: ScaledKVCache, meta) -> torch.Tensor:
        return self.kernels.paged_decode_attention_int8(q.contiguous(), kv_cache.data, kv_cache.scale,
                                                        meta.decode_block_tables, meta.decode_context_lens,
                                                        self.scale)


class TritonScaledPagedAttention(ScaledPagedAttention):
    """CUDA: decode and prefill attention by `kernels/triton_paged_attention.py`, reading the int8 / fp8 cache in
    place; the write quantizes in torch."""

    graph_safe = True

    def attend(self, q, k, v, kv_cache: ScaledKVCache, meta) -> torch.Tensor:
        planes = (kv_cache.data[0], kv_cache.data[1], kv_cache.scale[0], kv_cache.scale[1])
        return triton_attend(q, planes, meta, self.scale)


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

    def install(self, model: Transformer, device: torch.device) -> None:
        """The native CPU attention where it applies (int8, bf16 on CPU), Triton's on CUDA, the reference else."""
        kernels = bf16_kernels() if device.type == "cpu" and self.dtype == torch.bfloat16 else None
        head_dim = model.config.head_dim
        for layer in model.layers:
            heads = layer.self_attn.attn.heads
            if self.name == "int8" and CpuPagedAttention.supports(kernels, self.dtype, device, head_dim):
                layer.self_attn.attn = CpuInt8PagedAttention(heads, kernels)
            elif device.type == "cuda" and triton_available():
                layer.self_attn.attn = TritonScaledPagedAttention(heads, self.quantize)
            else:
                layer.self_attn.attn = ScaledPagedAttention(heads, self.quantize)


KVCacheFormat = DenseKVFormat | ScaledKVFormat


def kv_cache_format(name: str, dtype: torch.dtype, device: torch.device) -> KVCacheFormat:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    if name == "fp8" and device.type != "cuda":
        raise ModelLoadError("an fp8 KV cache needs a CUDA GPU; on CPU use kv_cache_dtype='int8'")
    return DenseKVFormat(dtype) if name == "auto" else ScaledKVFormat(name, dtype)
