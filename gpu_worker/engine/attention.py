"""Paged attention behind one small interface: write this step's K/V into the block cache, then attend.

`TorchPagedAttention` is the reference (and the CPU path). The flattened batch holds decode tokens first,
sorted by context length (one query token each, attended in groups of similar length), then prefill
chunks (each attended on its own, causally, over its cached context plus the chunk).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import ops
from .host_memory import to_device, zeros_streamed
from .kv_cache_manager import cdiv


@dataclass
class PrefillChunk:
    query_start: int
    query_len: int
    context_len: int  # tokens in the sequence after this chunk, the chunk included
    block_table: torch.Tensor  # [num_blocks] int64

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[query_len, context_len], causal aligned to the bottom right (row i sees the cache and 0..i); None when
        nothing is cached before the chunk. Built only where the torch path attends."""
        if self.context_len == self.query_len:
            return None
        device = self.block_table.device
        rows = torch.arange(self.query_len, device=device)[:, None] + (self.context_len - self.query_len)
        return torch.arange(self.context_len, device=device)[None, :] <= rows


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
    """Decode rows [start, end): one query token each, attended together over contexts padded to the longest."""

    start: int
    end: int
    block_tables: torch.Tensor  # [rows, max_blocks]
    max_context: int
    mask: torch.Tensor  # [rows, 1, 1, max_context]

    @classmethod
    def build(cls, rows: range, block_tables: torch.Tensor, context_lens: torch.Tensor, max_context: int,
              block_size: int) -> DecodeGroup:
        tables = block_tables[rows.start:rows.stop, : cdiv(max_context, block_size)]
        positions = torch.arange(max_context, device=tables.device)
        mask = (positions[None, :] < context_lens[rows.start:rows.stop, None])[:, None, None, :]
        return cls(rows.start, rows.stop, tables, max_context, mask)


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
    """Built once per step by the model runner, shared by every layer."""

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

    @functools.cached_property
    def decode_groups(self) -> list[DecodeGroup]:
        """The decode rows split by length for the torch path; built on first use, once per step."""
        lens = self.decode_context_list
        return [DecodeGroup.build(rows, self.decode_block_tables, self.decode_context_lens,
                                  max(lens[rows.start:rows.stop]), self.block_size) for rows in group_by_context(lens)]


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    # Head-major within a block: one head's rows of a block are contiguous, so a decode kernel streams them.
    shape = (2, num_blocks, num_kv_heads, block_size, head_dim)
    return [zeros_streamed(shape, dtype, device) for _ in range(num_layers)]


@dataclass(frozen=True)
class HeadLayout:
    """A layer's attention heads: `num_heads` query heads sharing `num_kv_heads` key/value heads (GQA)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # of the scores, head_dim ** -0.5 in the models served

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
        ops.rotary_(qkv, cos, sin, self.heads.num_heads + self.heads.num_kv_heads, self.heads.head_dim)
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
            out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache, chunk)

    def write_kv(self, k, v, kv_cache, meta: AttentionMetadata) -> None:
        kv_cache[0][meta.slot_blocks, :, meta.slot_offsets] = k
        kv_cache[1][meta.slot_blocks, :, meta.slot_offsets] = v

    def gather(self, kv_cache, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `length` tokens through each row's block table: [B, KVH, length, D] each."""
        return _gather(kv_cache[0], block_tables, length), _gather(kv_cache[1], block_tables, length)

    def decode(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return torch.cat([self._decode_group(q[g.start:g.end], kv_cache, g) for g in meta.decode_groups])

    def _decode_group(self, q, kv_cache, group: DecodeGroup) -> torch.Tensor:
        keys, values = self.gather(kv_cache, group.block_tables, group.max_context)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys.to(q.dtype), values.to(q.dtype),
                                             attn_mask=group.mask, scale=self.scale, enable_gqa=True)
        return out[:, :, 0, :]

    def _prefill(self, q, k, v, kv_cache, chunk: PrefillChunk) -> torch.Tensor:
        q = q.transpose(0, 1)[None]
        if chunk.mask is None:  # nothing cached before this chunk: attend to it alone
            keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scale,
                                                 enable_gqa=True)
        else:
            keys, values = self.gather(kv_cache, chunk.block_table[None], chunk.context_len)
            out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=chunk.mask,
                                                 scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)


class WidenedDecodeAttention(TorchPagedAttention):
    """The torch path for bf16 on CPUs where the native kernels do not apply (no compiler, or a head size they do
    not take), its decode attention in float32: torch's bf16 flash attention for one query row ran 2.5-3.8x slower
    than its float32 one at 200-512 tokens of context on a Zen 3 (218 against 86 us at 200), more than the upcast
    costs. Prefill chunks, where the two were within 10 %, stay in bf16."""

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

    def __call__(self, qkv, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.prefills:
            return super().__call__(qkv, cos, sin, kv_cache, meta)
        return self.kernels.decode_step_bf16(qkv, cos, sin, kv_cache, *decode_step_arguments(meta, self.heads))

    @staticmethod
    def supports(kernels, dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        return kernels is not None and dtype == torch.bfloat16 and device.type == "cpu" and head_dim % 32 == 0

    def write_kv(self, k, v, kv_cache, meta: AttentionMetadata) -> None:
        self.kernels.write_kv_bf16(k, v, kv_cache[0], kv_cache[1], meta.slot_blocks, meta.slot_offsets)

    def decode(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.kernels.paged_decode_attention_bf16(q, kv_cache[0], kv_cache[1],
                                                        meta.decode_block_tables, meta.decode_context_lens,
                                                        self.scale)


class NativePrefillAttention(CpuPagedAttention):
    """`CpuPagedAttention` with prefill chunks by the module's native kernel too: all of a step's in one call,
    straight from the paged cache, on AMX tiles (`kernels/amx_prefill_attention.cpp`) where the CPU has them and
    Linux grants them, else with AVX512-BF16 dot products (`kernels/avx512_prefill_attention.cpp`). torch's flash
    attention over each chunk's (gathered) context took 30 % of a prefill step on a Sapphire Rapids VM and 17 % of
    the mixed workload on a Zen 5, its bf16 products through MKL's generic fp32 path on AMD."""

    def prefill(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        batch = meta.prefill_batch
        self.kernels.prefill_attention_bf16(q, kv_cache[0], kv_cache[1], batch.query_starts, batch.query_lens,
                                            batch.context_lens, batch.block_tables, self.scale, out)

    @staticmethod
    def supports(kernels, dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        # The AMX build's kernel needs Linux's leave to use the tiles; the AVX512-BF16 build's has no such check.
        return (CpuPagedAttention.supports(kernels, dtype, device, head_dim) and head_dim <= 128
                and hasattr(kernels, "prefill_attention_bf16")
                and (not hasattr(kernels, "amx_usable") or kernels.amx_usable()))


class TritonPagedAttention(TorchPagedAttention):
    """CUDA: rotary and the KV write in one kernel (`kernels/triton_ops.py`), decode and prefill attention straight
    from the paged cache (`kernels/triton_paged_attention.py`), no context gathered. A decode-only step reads only
    the metadata's tensors, so a CUDA graph can replay it."""

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
        return triton_attend(q, (kv_cache[0], kv_cache[1], None, None), meta, self.scale).view(qkv.shape[0], -1)


def triton_attend(q: torch.Tensor, planes: tuple, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The step's attention by the Triton kernels over a cache whose `planes` are (keys, values, key scales, value
    scales), the scales None for a dense cache; this step's keys and values are in it already."""
    from .kernels.triton_paged_attention import paged_decode, paged_prefill

    out = q.new_empty(q.shape)
    if meta.num_decodes:
        paged_decode(q[:meta.num_decodes], planes[0], planes[1], meta.decode_block_tables, meta.decode_context_lens,
                     scale, planes[2], planes[3], out=out[:meta.num_decodes])
    if meta.prefills:
        batch = meta.prefill_batch
        paged_prefill(q, planes[0], planes[1], batch.block_tables, batch.query_starts, batch.query_lens,
                      batch.context_lens, batch.max_query_len, scale, planes[2], planes[3], out=out)
    return out


def decode_step_arguments(meta: AttentionMetadata, heads: HeadLayout) -> tuple:
    """What the native decode steps take after the cache."""
    return (meta.slot_blocks, meta.slot_offsets, meta.decode_block_tables, meta.decode_context_lens, heads.num_heads,
            heads.num_kv_heads, heads.scale)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[blocks, KVH, block_size, D] cache, [B, nb] tables -> [B, KVH, length, D]."""
    batch, num_blocks = block_tables.shape
    _, heads, block_size, dim = cache.shape
    blocks = cache.index_select(0, block_tables.flatten()).view(batch, num_blocks, heads, block_size, dim)
    return blocks.transpose(1, 2).reshape(batch, heads, num_blocks * block_size, dim)[:, :, :length]
