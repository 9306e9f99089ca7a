"""How much GPU memory the KV cache may take: what `gpu_memory_utilization` leaves after the weights, everything
else on the card, and the activations of the largest step, measured by running that step once.

Sizing the pool from the free memory alone left nothing for activations: a full prefill step at the token budget,
then its logits and the sampler's sort, ran out of memory under load. vLLM profiles the same way (a dummy forward
at max_num_batched_tokens before the KV cache is allocated).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .attention import AttentionMetadata, PrefillChunk
from .kv_cache_manager import cdiv
from .model import Transformer
from .sampler import Sampler, SamplingBatch
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


def largest_step(model: Transformer, kv_format, block_size: int, max_tokens: int, max_model_len: int,
                 max_rows: int, device: torch.device) -> tuple[list, Callable[[], None]]:
    """(KV caches just large enough, a function running on them the largest step the scheduler makes):
    `max_tokens` prompt tokens in chunks of at most max_model_len, their logits and a filtering sampler with
    logprobs over `max_rows` rows, the most sequences one step samples."""
    cfg = model.config
    lengths = [min(max_model_len, max_tokens - start) for start in range(0, max_tokens, max_model_len)]
    blocks = [cdiv(n, block_size) for n in lengths]
    caches = kv_format.allocate(cfg.num_layers, sum(blocks), block_size, cfg.num_kv_heads, cfg.head_dim, device)

    @torch.inference_mode()
    def run() -> None:
        chunks, slots, first_block, first_row = [], [], 0, 0
        for n, count in zip(lengths, blocks, strict=True):
            chunks.append(PrefillChunk(first_row, n, n, torch.arange(first_block, first_block + count, device=device)))
            slots.append(torch.arange(n, device=device) + first_block * block_size)
            first_block, first_row = first_block + count, first_row + n
        slot = torch.cat(slots)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        meta = AttentionMetadata(slot // block_size, slot % block_size, block_size, [], None, None, chunks)
        hidden = model(torch.zeros(max_tokens, dtype=torch.long, device=device), positions, caches,
                       [meta] * cfg.num_layers)
        rows = min(max_rows, max_tokens)
        params = [SamplingParams(temperature=0.8, top_p=0.9, logprobs=1)] * rows
        Sampler(model.ops)(model.logits(hidden[:rows]), SamplingBatch(params, [0.5] * rows, [[]] * rows, [[]] * rows))

    return caches, run


def peak_step_bytes(model: Transformer, kv_format, block_size: int, max_tokens: int, max_model_len: int,
                    max_rows: int, device: torch.device) -> int:
    """Bytes the largest step allocates at its peak beyond what is allocated already (the few KV blocks it writes
    into not counted)."""
    caches, run = largest_step(model, kv_format, block_size, max_tokens, max_model_len, max_rows, device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches
    torch.cuda.empty_cache()
    return peak


def kv_cache_budget(model: Transformer, kv_format, block_size: int, max_tokens: int, max_model_len: int,
                    max_rows: int, graph_rows: int, gpu_memory_utilization: float, device: torch.device) -> int:
    """Bytes for the KV cache: gpu_memory_utilization of the card, less what is in use now (weights, the CUDA
    context, other processes), a step's peak activations, and CUDA graphs' share (their pool holds a decode step
    of `graph_rows` rows: activations scale with rows)."""
    step = peak_step_bytes(model, kv_format, block_size, max_tokens, max_model_len, max_rows, device)
    graphs = step * min(1.0, graph_rows / max_tokens)
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * gpu_memory_utilization - (total - free) - step - graphs)
    log.info("GPU memory: %.1f GiB in use after loading, a full step's activations %.2f GiB, CUDA graphs about "
             "%.2f GiB: %.1f GiB for the KV cache at gpu_memory_utilization %.2f", (total - free) / 2**30,
             step / 2**30, graphs / 2**30, budget / 2**30, gpu_memory_utilization)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization} leaves no memory for the KV cache after "
                         "the weights and a step's activations: raise it, lower max_num_batched_tokens, or set "
                         "kv_cache_memory_bytes")
    return budget
