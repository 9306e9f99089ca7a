"""Paged attention on CUDA by the Triton kernels, over caches in the serving dtype and int8 / fp8 ones: decode and
prefill attention straight from the paged cache (`kernels/triton_paged_attention.py`), no context gathered. Each
is tested against the reference it subclasses (`attention.py`)."""

from __future__ import annotations

import torch

from .attention import AttentionMetadata, HeadLayout, ScaledPagedAttention, TorchPagedAttention
from .kv_cache_format import ScaledKVCache, quantize_per_row
from .ops import TritonOps


class TritonPagedAttention(TorchPagedAttention):
    """Rotary and the KV write in one kernel (`kernels/triton_ops.py`), then the attention. A decode-only step reads
    only the metadata's tensors, so a CUDA graph can replay it."""

    graph_safe = True

    def __init__(self, heads: HeadLayout):
        from .kernels import triton_ops

        super().__init__(heads)
        self.triton_ops = triton_ops

    def __call__(self, qkv, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        h = self.heads
        self.triton_ops.rotary_and_write_kv_(qkv, cos, sin, h.num_heads, h.num_kv_heads, h.head_dim, kv_cache,
                                             meta.slot_blocks, meta.slot_offsets)
        q = qkv[:, : h.num_heads * h.head_dim].view(-1, h.num_heads, h.head_dim)
        return triton_attend(q, (kv_cache[0], kv_cache[1], None, None), meta, self.scale, self.heads.window,
                             self.sinks).view(qkv.shape[0], -1)


class TritonScaledPagedAttention(ScaledPagedAttention):
    """Over an int8 / fp8 cache, read in place; the rotary by Triton's kernel, the write quantizes in torch."""

    graph_safe = True

    def __init__(self, heads: HeadLayout, quantize=quantize_per_row):
        super().__init__(heads, quantize)
        self.ops = TritonOps()

    def attend(self, q, k, v, kv_cache: ScaledKVCache, meta: AttentionMetadata) -> torch.Tensor:
        planes = (kv_cache.data[0], kv_cache.data[1], kv_cache.scale[0], kv_cache.scale[1])
        return triton_attend(q, planes, meta, self.scale, self.heads.window, self.sinks)


def triton_attend(q: torch.Tensor, planes: tuple, meta: AttentionMetadata, scale: float,
                  window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The step's attention by the Triton kernels over a cache whose `planes` are (keys, values, key scales, value
    scales), the scales None for a dense cache; this step's keys and values are in it already. `window`: the
    layer's sliding window (None: full attention); `sinks`: its heads' sink logits (None: no sinks)."""
    from .kernels.triton_paged_attention import paged_decode, paged_prefill

    out = q.new_empty(q.shape)
    if meta.num_decodes:
        paged_decode(q[:meta.num_decodes], planes[0], planes[1], meta.decode_block_tables, meta.decode_context_lens,
                     scale, planes[2], planes[3], out=out[:meta.num_decodes], window=window, sinks=sinks)
    if meta.prefills:
        batch = meta.prefill_batch
        paged_prefill(q, planes[0], planes[1], batch.block_tables, batch.query_starts, batch.query_lens,
                      batch.context_lens, batch.max_query_len, scale, planes[2], planes[3], out=out, window=window,
                      sinks=sinks)
    return out
