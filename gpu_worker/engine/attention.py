"""Paged attention behind one small interface: write this step's K/V into the block cache, then attend.

`TorchPagedAttention` is the reference over a cache in the serving dtype, `ScaledPagedAttention` over an int8 / fp8
one; the native CPU kernels (`cpu_attention.py`) and the Triton ones (`triton_attention.py`) subclass them, and
`kernel_choice` picks one per model. The flattened batch holds decode tokens first, sorted by context length (one
query token each, attended in groups of similar length), then prefill chunks (each attended on its own, causally,
over its cached context plus the chunk).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .host_memory import to_device
from .kv_cache_format import ScaledKVCache, quantize_per_row
from .kv_cache_manager import cdiv
from .ops import TorchOps


@dataclass
class PrefillChunk:
    query_start: int
    query_len: int
    context_len: int  # tokens in the sequence after this chunk, the chunk included
    block_table: torch.Tensor  # [num_blocks] int64; entries before the first one a window sees may be freed (-1)

    def first_key(self, window: int | None) -> int:
        """The first position any of the chunk's rows sees: 0, or with a window of `window` tokens (each row sees
        itself and the window - 1 before it) the first row's."""
        return 0 if window is None else max(0, self.context_len - self.query_len - window + 1)

    def mask(self, window: int | None, first: int) -> torch.Tensor:
        """[query_len, context_len - first] over the positions from `first`: causal aligned to the bottom right
        (row i sees the cache and 0..i), and with a window the last `window` positions only. Built only where the
        torch path attends."""
        device = self.block_table.device
        rows = torch.arange(self.query_len, device=device)[:, None] + (self.context_len - self.query_len)
        keys = torch.arange(first, self.context_len, device=device)[None, :]
        visible = keys <= rows
        return visible if window is None else visible & (keys > rows - window)


@dataclass
class PrefillBatch:
    """A step's prefill chunks as the varlen kernels take them: one entry per chunk."""

    query_starts: torch.Tensor  # [C] each chunk's first row in the step
    query_lens: torch.Tensor  # [C]
    context_lens: torch.Tensor  # [C]
    block_tables: torch.Tensor  # [C, max_blocks], zero-padded
    max_query_len: int

    @classmethod
    def of(cls, chunks: list[PrefillChunk]) -> PrefillBatch:
        device = chunks[0].block_table.device
        columns = [[c.query_start for c in chunks], [c.query_len for c in chunks], [c.context_len for c in chunks]]
        starts, lens, contexts = to_device(columns, torch.long, device)
        tables = torch.nn.utils.rnn.pad_sequence([c.block_table for c in chunks], batch_first=True)
        return cls(starts, lens, contexts, tables, max(c.query_len for c in chunks))


@dataclass
class DecodeGroup:
    """Decode rows [start, end): one query token each, attended together over contexts padded to the longest,
    from the first block any of them sees."""

    start: int
    end: int
    block_tables: torch.Tensor  # [rows, blocks seen], from the first block any row sees
    length: int  # positions gathered: from that block's first to the longest context's end
    mask: torch.Tensor  # [rows, 1, 1, length]

    @classmethod
    def build(cls, rows: range, block_tables: torch.Tensor, context_lens: torch.Tensor, contexts: list[int],
              block_size: int, window: int | None) -> DecodeGroup:
        """`contexts`: the rows' context lengths, as a list; with a `window`, each row sees its last `window`."""
        first_block = 0 if window is None else max(0, min(contexts) - window) // block_size
        tables = block_tables[rows.start:rows.stop, first_block: cdiv(max(contexts), block_size)]
        first = first_block * block_size
        positions = torch.arange(first, max(contexts), device=tables.device)[None, :]
        lens = context_lens[rows.start:rows.stop, None]
        mask = positions < lens if window is None else (positions < lens) & (positions >= lens - window)
        return cls(rows.start, rows.stop, tables, max(contexts) - first, mask[:, None, None, :])


def group_by_context(context_lens: list[int], growth: float = 1.5) -> list[range]:
    """Split rows sorted by context length where it grows past `growth`x the group's shortest: padding
    every decode to the batch's longest context would gather and attend mostly padding."""
    groups, first = [], 0
    for i in range(1, len(context_lens) + 1):
        if i == len(context_lens) or context_lens[i] > growth * context_lens[first]:
            groups.append(range(first, i))
            first = i
    return groups


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner for each KV-cache group, shared by the group's layers."""

    slot_blocks: torch.Tensor  # [num_tokens] block of each new token's KV
    slot_offsets: torch.Tensor  # [num_tokens] its row in that block
    block_size: int
    decode_context_list: list[int]  # context length of each decode row, shortest first
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], zero-padded
    decode_context_lens: torch.Tensor | None  # [num_decodes]
    prefills: list[PrefillChunk]

    @classmethod
    def decode_rows(cls, tables: list[list[int]], context_lens: list[int], block_size: int,
                    device: torch.device | str = "cpu") -> AttentionMetadata:
        """A decode-only step's: row i attends over its context_lens[i] tokens through block table tables[i], its
        new token the context's last (written there before attention reads it). What kernel tests and benchmarks
        run a layer's attention on, without a scheduler."""
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
        lens = torch.tensor(context_lens, device=device)
        slot_blocks = torch.tensor([t[(n - 1) // block_size] for t, n in zip(tables, context_lens, strict=True)],
                                   device=device)
        return cls(slot_blocks, (lens - 1) % block_size, block_size, list(context_lens), padded, lens, [])

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context_list)

    @functools.cached_property
    def prefill_batch(self) -> PrefillBatch:
        """The prefill chunks for the varlen kernels; built on first use, once per step."""
        return PrefillBatch.of(self.prefills)

    def decode_groups(self, window: int | None) -> list[DecodeGroup]:
        """The decode rows split by length for the torch path, each row seeing its last `window` positions (None:
        all); built on first use, once per step and window."""
        groups = self._decode_groups.get(window)
        if groups is None:
            lens = self.decode_context_list
            groups = self._decode_groups[window] = [
                DecodeGroup.build(rows, self.decode_block_tables, self.decode_context_lens,
                                  lens[rows.start:rows.stop], self.block_size, window)
                for rows in group_by_context(lens)]
        return groups

    @functools.cached_property
    def _decode_groups(self) -> dict[int | None, list[DecodeGroup]]:
        return {}


@dataclass(frozen=True)
class HeadLayout:
    """A layer's attention heads: `num_heads` query heads sharing `num_kv_heads` key/value heads (GQA)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # of the scores, head_dim ** -0.5 in the models served
    window: int | None = None  # sliding-window attention: each token sees itself and the window - 1 before it
    softcap: float | None = None  # scores soft-capped to softcap * tanh(score / softcap) (Gemma 2)
    sinks: bool = False  # each head's softmax joined by a learned logit of its own, no value behind it (gpt-oss)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's rows [T, (H + 2 KVH) D] as views q [T, H, D], k and v [T, KVH, D]."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        return q.view(-1, h, d), k.view(-1, kvh, d), v.view(-1, kvh, d)


class TorchPagedAttention:
    # Whether a decode-only step reads only tensors of the metadata, none of its Python lists, so that a CUDA graph
    # captured once replays it for other contexts: not here, where decode rows are grouped by their lengths.
    graph_safe = False
    # Whether a decode-only step attends each row on its own, in an order that does not depend on the other rows
    # (batch-invariant mode needs it): not here, where a group's rows attend over contexts padded to its longest.
    row_invariant_decode = False
    # The rotary embedding's kernel, the one element-wise op attention runs.
    ops: TorchOps = TorchOps()
    # Where the heads have sinks: their logits [H], float32, handed over once loaded (`model.Attention.pack`).
    sinks: torch.Tensor | None = None

    def __init__(self, heads: HeadLayout):
        self.heads = heads

    @property
    def scale(self) -> float:
        return self.heads.scale

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """qkv: the fused projection [T, (H + 2 KVH) D], its q and k heads rotated here in place; kv_cache:
        [2, blocks, KVH, block_size, D]. Writes this step's keys and values, returns the attention [T, H D]."""
        # q and k heads are adjacent columns: rotate them in one pass.
        self.ops.rotary_(qkv, cos, sin, self.heads.num_heads + self.heads.num_kv_heads, self.heads.head_dim)
        q, k, v = self.heads.split(qkv)
        self.write_kv(k, v, kv_cache, meta)
        return self.attend(q, k, v, kv_cache, meta).view(qkv.shape[0], -1)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D], already in the cache. Returns [T, H, D]."""
        if not meta.prefills:  # decode-only steps (batch-1 latency) skip the scatter into `out`
            return self.decode(q, kv_cache, meta)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[:meta.num_decodes] = self.decode(q[:meta.num_decodes], kv_cache, meta)
        self.prefill(q, k, v, kv_cache, meta, out)
        return out

    def prefill(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """The prefill chunks' attention into their rows of `out` [T, H, D]."""
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache, chunk, meta.block_size)

    def write_kv(self, k, v, kv_cache, meta: AttentionMetadata) -> None:
        kv_cache[0][meta.slot_blocks, :, meta.slot_offsets] = k
        kv_cache[1][meta.slot_blocks, :, meta.slot_offsets] = v

    def gather(self, kv_cache, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `length` tokens through each row's block table: [B, KVH, length, D] each."""
        return _gather(kv_cache[0], block_tables, length), _gather(kv_cache[1], block_tables, length)

    def decode(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return torch.cat([self._decode_group(q[g.start:g.end], kv_cache, g)
                          for g in meta.decode_groups(self.heads.window)])

    def _decode_group(self, q, kv_cache, group: DecodeGroup) -> torch.Tensor:
        keys, values = self.gather(kv_cache, group.block_tables, group.length)
        out = self._attention(q[:, :, None, :], keys.to(q.dtype), values.to(q.dtype), group.mask)
        return out[:, :, 0, :]

    def _attention(self, q, keys, values, mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T * scale, masked) v over [B, H, rows, D] q and [B, KVH, length, D] keys and values; None: a
        causal mask. Soft-capped scores and sinks are computed as they are in transformers (eager attention)."""
        if self.heads.softcap is None and not self.heads.sinks:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                  scale=self.scale, enable_gqa=True)
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        if self.heads.softcap is not None:
            scores = torch.tanh(scores / self.heads.softcap) * self.heads.softcap
        if mask is None:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.heads.sinks:
            if self.sinks is None:
                raise RuntimeError("attention with sinks called before its sink logits were handed over")
            return torch.matmul(softmax_with_sinks(scores.float(), self.sinks).to(q.dtype), values)
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)

    def _prefill(self, q, k, v, kv_cache, chunk: PrefillChunk, block_size: int) -> torch.Tensor:
        q = q.transpose(0, 1)[None]
        window = self.heads.window
        if chunk.context_len == chunk.query_len and (window is None or window >= chunk.query_len):
            # nothing cached before this chunk, and no window inside it: attend to the chunk alone, causally
            out = self._attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], None)
        else:
            first_block = chunk.first_key(window) // block_size
            first = first_block * block_size
            keys, values = self.gather(kv_cache, chunk.block_table[None, first_block:], chunk.context_len - first)
            out = self._attention(q, keys.to(q.dtype), values.to(q.dtype), chunk.mask(window, first))
        return out[0].transpose(0, 1)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over each row of [B, H, rows, L] scores joined by its head's sink logit, the sink's share then
    dropped: it takes probability mass and adds no value. transformers' gpt-oss eager attention, the row's max
    subtracted first as there."""
    joined = torch.cat([scores, sinks[:, None, None].expand(*scores.shape[:-1], 1)], dim=-1)
    joined = joined - joined.amax(dim=-1, keepdim=True)
    return torch.softmax(joined, dim=-1)[..., :-1]


class ScaledPagedAttention(TorchPagedAttention):
    """The reference over an int8 / fp8 cache (`kv_cache_format.ScaledKVCache`): quantize on write, dequantize what a
    step gathers."""

    def __init__(self, heads: HeadLayout, quantize=quantize_per_row):
        super().__init__(heads)
        self.quantize = quantize

    def write_kv(self, k, v, kv_cache: ScaledKVCache, meta: AttentionMetadata) -> None:
        for i, x in enumerate((k, v)):
            q, scale = self.quantize(x)
            kv_cache.data[i][meta.slot_blocks, :, meta.slot_offsets] = q
            kv_cache.scale[i][meta.slot_blocks, :, meta.slot_offsets] = scale

    def gather(self, kv_cache: ScaledKVCache, block_tables: torch.Tensor, length: int):
        return tuple(_gather(kv_cache.data[i], block_tables, length).to(kv_cache.scale.dtype)
                     * _gather(kv_cache.scale[i][..., None], block_tables, length) for i in (0, 1))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[blocks, KVH, block_size, D] cache, [B, nb] tables -> [B, KVH, length, D]. A freed entry (-1, out of a
    window) gathers block 0 in its place: the mask hides what it holds."""
    batch, num_blocks = block_tables.shape
    _, heads, block_size, dim = cache.shape
    blocks = cache.index_select(0, block_tables.flatten().clamp(min=0)).view(batch, num_blocks, heads, block_size,
                                                                            dim)
    return blocks.transpose(1, 2).reshape(batch, heads, num_blocks * block_size, dim)[:, :, :length]
