"""Inputs the kernel tests share: seeded weights, and decode rows over shuffled block tables."""

from __future__ import annotations

import torch

from gpu_worker.engine.attention import AttentionMetadata


def decode_metadata(context_lens: list[int], num_blocks: int, block_size: int) -> AttentionMetadata:
    """One decode row per context length, each through its own shuffled blocks of a pool of `num_blocks`."""
    gen = torch.Generator().manual_seed(len(context_lens))
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for length in context_lens:
        need = -(-length // block_size)
        tables.append(blocks[:need])
        blocks = blocks[need:]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    no_tokens = torch.empty(0, dtype=torch.long)
    return AttentionMetadata(no_tokens, no_tokens, block_size, context_lens, padded, torch.tensor(context_lens), [])


def seeded_weight(n: int, k: int) -> torch.Tensor:
    """An [n, k] float32 weight, the same for the same shape in every test, of a trained layer's magnitude."""
    torch.manual_seed(n * 7919 + k)
    return torch.randn(n, k) * 0.05
