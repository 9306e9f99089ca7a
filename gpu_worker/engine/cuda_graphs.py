"""Decode-only steps replayed from CUDA graphs: one graph per batch bucket, captured at start-up.

A decode step of a few rows launches hundreds of small kernels; on a fast GPU launching them takes longer than
running them. A graph replays the whole forward in one launch. Each bucket's graph reads its inputs from static
buffers: a step of n rows copies its inputs into the first n and pads to the bucket with rows that write their
keys and values into a block of their own (the padding block, never handed out) and attend to one token. The
attention must be `graph_safe` (read only the metadata's tensors); the split count of the Triton decode kernel
depends on the tables' width, which is fixed here, so one graph serves every context length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from .attention import AttentionMetadata
from .model import Transformer

log = logging.getLogger(__name__)

Replay = Callable[[], torch.Tensor]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to max_num_seqs, and max_num_seqs itself."""
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return [*buckets, max_num_seqs]


def capture_cuda_graph(forward: Callable[[], torch.Tensor], pool) -> Replay:
    """Capture `forward` (its Triton kernels compiled by a warm-up run first) into a graph in the shared `pool`;
    replaying it recomputes the returned tensor in place."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


class NoDecodeGraphs:
    """Every step eager: CPU, CUDA with graphs turned off, or an attention a graph cannot replay."""

    def covers(self, metas: list[AttentionMetadata]) -> bool:
        return False


class DecodeGraphs:
    def __init__(self, model: Transformer, kv_caches: list, layer_groups: list[int], block_size: int,
                 max_num_seqs: int, max_blocks_per_seq: int, padding_block: int, device: torch.device,
                 capture: Callable[[Callable[[], torch.Tensor], object], Replay] = capture_cuda_graph):
        """`layer_groups`: each layer's KV-cache group (`kv_cache_groups.py`), each group with static block tables
        and slots of its own."""
        self.model = model
        self.kv_caches = kv_caches
        self.layer_groups = layer_groups
        self.buckets = batch_buckets(max_num_seqs)
        self.block_size = block_size
        self.padding_block = padding_block
        self.capture = capture
        rows, as_long = self.buckets[-1], {"dtype": torch.long, "device": device}
        groups = range(max(layer_groups) + 1)
        self.input_ids = torch.zeros(rows, **as_long)
        self.positions = torch.zeros(rows, **as_long)
        self.slot_blocks = [torch.full((rows,), padding_block, **as_long) for _ in groups]
        self.slot_offsets = torch.zeros(rows, **as_long)
        self.block_tables = [torch.zeros(rows, max_blocks_per_seq, **as_long) for _ in groups]
        self.context_lens = torch.ones(rows, **as_long)
        self.replays: dict[int, Replay] = {}

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Largest bucket first, all in one memory pool: the smaller graphs reuse the largest one's memory."""
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        for bucket in reversed(self.buckets):
            self.replays[bucket] = self.capture(self._forward(bucket), pool)
        used = free_before - torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        log.info("CUDA graphs for decode batches of %s captured in %.1f s, %.0f MiB", self.buckets,
                 time.perf_counter() - started, used / 2**20)

    def _forward(self, rows: int) -> Callable[[], torch.Tensor]:
        metas = [AttentionMetadata(slots[:rows], self.slot_offsets[:rows], self.block_size, [1] * rows, tables[:rows],
                                   self.context_lens[:rows], [])
                 for slots, tables in zip(self.slot_blocks, self.block_tables, strict=True)]
        by_layer = [metas[g] for g in self.layer_groups]
        return lambda: self.model(self.input_ids[:rows], self.positions[:rows], self.kv_caches, by_layer)

    def covers(self, metas: list[AttentionMetadata]) -> bool:
        """Whether a graph runs this step: decode rows only, no more than the largest bucket, tables that fit."""
        meta = metas[0]
        return (not meta.prefills and 0 < meta.num_decodes <= self.buckets[-1]
                and all(m.decode_block_tables.shape[1] <= t.shape[1] for m, t in zip(metas, self.block_tables,
                                                                                    strict=True)))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata]) -> torch.Tensor:
        """The step's final hidden states [rows, hidden], as the model's forward returns them."""
        rows = metas[0].num_decodes
        bucket = next(b for b in self.buckets if b >= rows)
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.slot_offsets[:rows].copy_(metas[0].slot_offsets, non_blocking=True)
        self.context_lens[:rows].copy_(metas[0].decode_context_lens, non_blocking=True)
        for meta, slots, tables in zip(metas, self.slot_blocks, self.block_tables, strict=True):
            slots[:rows].copy_(meta.slot_blocks, non_blocking=True)
            tables[:rows, :meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables, non_blocking=True)
            # Rows past this step's, up to the bucket: write into the padding block, attend to one token.
            slots[rows:bucket].fill_(self.padding_block)
        self.slot_offsets[rows:bucket].zero_()
        self.context_lens[rows:bucket].fill_(1)
        return self.replays[bucket]()[:rows]
