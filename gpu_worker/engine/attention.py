"""Paged attention behind one small interface: write this step's K/V into the block cache, then attend.

`TorchPagedAttention` is the reference (and the CPU path). The flattened batch holds decode tokens first
(one query token each, attended as one padded batch), then prefill chunks (each attended on its own,
causally, over its cached context plus the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int
    query_len: int
    context_len: int  # tokens in the sequence after this chunk, the chunk included
    block_table: torch.Tensor  # [num_blocks] int64
    mask: torch.Tensor | None  # [query_len, context_len]; None when nothing is cached before the chunk

    @classmethod
    def build(cls, query_start: int, query_len: int, context_len: int, block_table: torch.Tensor) -> PrefillChunk:
        mask = None
        if context_len != query_len:  # causal, aligned to the bottom right: row i sees the cache and 0..i
            device = block_table.device
            rows = torch.arange(query_len, device=device)[:, None] + (context_len - query_len)
            mask = torch.arange(context_len, device=device)[None, :] <= rows
        return cls(query_start, query_len, context_len, block_table, mask)


@dataclass
class DecodeBatch:
    """Sequences with one query token each, attended together over their contexts padded to the longest."""

    block_tables: torch.Tensor  # [num_decodes, max_blocks]
    max_context: int
    mask: torch.Tensor  # [num_decodes, 1, 1, max_context]

    @classmethod
    def build(cls, block_tables: torch.Tensor, context_lens: torch.Tensor) -> DecodeBatch:
        max_context = int(context_lens.max())
        positions = torch.arange(max_context, device=block_tables.device)
        mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
        return cls(block_tables, max_context, mask)


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decode_tokens: int
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


class TorchPagedAttention:
    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, blocks, block_size, KVH, D]. Returns [T, H, D]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        d = meta.num_decode_tokens
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        batch = meta.decode
        keys = _gather(k_cache, batch.block_tables, batch.max_context)  # [B, KVH, L, D]
        values = _gather(v_cache, batch.block_tables, batch.max_context)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=batch.mask,
                                             scale=self.scale, enable_gqa=True)
        return out[:, :, 0, :]

    def _prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk) -> torch.Tensor:
        q = q.transpose(0, 1)[None]
        if chunk.mask is None:  # nothing cached before this chunk: attend to it alone
            keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scale,
                                                 enable_gqa=True)
        else:
            tables = chunk.block_table[None]
            keys = _gather(k_cache, tables, chunk.context_len)
            values = _gather(v_cache, tables, chunk.context_len)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=chunk.mask, scale=self.scale,
                                                 enable_gqa=True)
        return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[blocks, block_size, KVH, D] cache, [B, nb] tables -> [B, KVH, length, D]."""
    batch = block_tables.shape[0]
    blocks = cache.index_select(0, block_tables.flatten())  # [B * nb, block_size, KVH, D]
    flat = blocks.view(batch, -1, *cache.shape[2:])[:, :length]
    return flat.transpose(1, 2)
