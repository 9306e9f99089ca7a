"""Paged attention on CPU by the native kernels (`kernels.NativeKernels.bf16`: the AVX512-BF16 module or the AVX2
one), over bf16 and int8 caches, and the torch path bf16 takes where they do not apply. Each is tested against the
reference it subclasses (`attention.py`). Each native kernel takes the layer's sliding window (`window_arg`) and reads
only the keys each row sees, from its window's first on, and the heads' attention sinks where they have them
(gpt-oss)."""

from __future__ import annotations

import torch

from .attention import AttentionMetadata, DecodeGroup, HeadLayout, ScaledPagedAttention, TorchPagedAttention
from .kv_cache_format import ScaledKVCache
from .ops import NativeCpuOps


class WidenedDecodeAttention(TorchPagedAttention):
    """The torch path for bf16 on CPUs where the native kernels do not apply (no compiler, or a head size they do
    not take), its decode attention in float32: torch's bf16 attention for one query row is slower on CPU than its
    float32 one by more than the upcast costs. Prefill chunks, where the two are level, stay in bf16."""

    def _decode_group(self, q, kv_cache, group: DecodeGroup) -> torch.Tensor:
        return super()._decode_group(q.float(), kv_cache, group).to(q.dtype)


class CpuPagedAttention(TorchPagedAttention):
    """KV writes and decode attention straight from the paged cache (bf16 on CPU) by the native kernels:
    `kernels/cpu_attention_kernels.cpp` on AVX512-BF16, `kernels/cpu_avx2_kernels.cpp` (in float32) on AVX2; a
    decode-only step's rotary, write and attention in one native call."""

    row_invariant_decode = True  # one task per (row, KV head), over exactly the row's context

    def __init__(self, heads: HeadLayout, kernels):
        super().__init__(heads)
        self.kernels = kernels
        self.ops = NativeCpuOps(kernels)

    @staticmethod
    def takes(kernels, head_dim: int) -> bool:
        """Whether `kernels` (a native bf16 module) serve heads of `head_dim`; the int8 cache's kernels likewise."""
        return head_dim % 32 == 0

    def __call__(self, qkv, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.prefills:
            return super().__call__(qkv, cos, sin, kv_cache, meta)
        return self.kernels.decode_step_bf16(qkv, cos, sin, kv_cache, *decode_step_arguments(meta, self.heads),
                                             self.sinks)

    def write_kv(self, k, v, kv_cache, meta: AttentionMetadata) -> None:
        self.kernels.write_kv_bf16(k, v, kv_cache[0], kv_cache[1], meta.slot_blocks, meta.slot_offsets)

    def decode(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.kernels.paged_decode_attention_bf16(q, kv_cache[0], kv_cache[1],
                                                        meta.decode_block_tables, meta.decode_context_lens,
                                                        self.scale, window_arg(self.heads), self.sinks)


class NativePrefillAttention(CpuPagedAttention):
    """`CpuPagedAttention` with prefill chunks by the module's native kernel too: all of a step's in one call,
    straight from the paged cache, on AMX tiles (`kernels/amx_prefill_attention.cpp`) where the CPU has them and
    Linux grants them, else with AVX512-BF16 dot products (`kernels/avx512_prefill_attention.cpp`), where torch's
    attention gathers each chunk's context and multiplies bf16 through MKL's generic fp32 path on AMD (the prefill
    steps of `tokenfleet bench engine`'s mixed workload)."""

    def prefill(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        batch = meta.prefill_batch
        self.kernels.prefill_attention_bf16(q, kv_cache[0], kv_cache[1], batch.query_starts, batch.query_lens,
                                            batch.context_lens, batch.block_tables, self.scale,
                                            window_arg(self.heads), self.sinks, out)

    @staticmethod
    def takes(kernels, head_dim: int) -> bool:
        # The AMX build's kernel needs Linux's leave to use the tiles; the AVX512-BF16 build's has no such check.
        return (CpuPagedAttention.takes(kernels, head_dim) and head_dim <= 128
                and hasattr(kernels, "prefill_attention_bf16")
                and (not hasattr(kernels, "amx_usable") or kernels.amx_usable()))


class CpuInt8PagedAttention(ScaledPagedAttention):
    """KV writes and decode attention by the native kernels (AVX-512's or AVX2's) on the int8 cache itself (bf16 on
    CPU): keys and values dequantized in registers, where the reference gathers a dequantized copy of every
    context; a decode-only step's rotary, write and attention in one native call. Prefill over a cached context
    attends over such a copy, gathered and dequantized in one pass (from the first block its window sees: freed
    entries are not read)."""

    row_invariant_decode = True  # one task per (row, KV head), over exactly the row's context

    def __init__(self, heads: HeadLayout, kernels):
        super().__init__(heads)
        self.kernels = kernels
        self.ops = NativeCpuOps(kernels)

    def __call__(self, qkv, cos, sin, kv_cache: ScaledKVCache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.prefills:
            return super().__call__(qkv, cos, sin, kv_cache, meta)
        return self.kernels.decode_step_int8(qkv, cos, sin, kv_cache.data, kv_cache.scale,
                                             *decode_step_arguments(meta, self.heads), self.sinks)

    def write_kv(self, k, v, kv_cache: ScaledKVCache, meta: AttentionMetadata) -> None:
        self.kernels.write_kv_int8(k, v, kv_cache.data, kv_cache.scale, meta.slot_blocks, meta.slot_offsets)

    def gather(self, kv_cache: ScaledKVCache, block_tables: torch.Tensor, length: int):
        return tuple(self.kernels.gather_int8_bf16(kv_cache.data, kv_cache.scale, i, block_tables, length)
                     for i in (0, 1))

    def decode(self, q, kv_cache: ScaledKVCache, meta: AttentionMetadata) -> torch.Tensor:
        return self.kernels.paged_decode_attention_int8(q.contiguous(), kv_cache.data, kv_cache.scale,
                                                        meta.decode_block_tables, meta.decode_context_lens,
                                                        self.scale, window_arg(self.heads), self.sinks)


def window_arg(heads: HeadLayout) -> int:
    """The layer's sliding window as the native kernels take it: its tokens, or 0 for full attention."""
    return heads.window or 0


def decode_step_arguments(meta: AttentionMetadata, heads: HeadLayout) -> tuple:
    """What the native decode steps take after the cache."""
    return (meta.slot_blocks, meta.slot_offsets, meta.decode_block_tables, meta.decode_context_lens, heads.num_heads,
            heads.num_kv_heads, heads.scale, window_arg(heads))
