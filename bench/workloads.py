"""Benchmark workloads, fixed by seed so every peer gets the same prompts and output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def batch1(vocab: int, prompt_len: int = 128, output_len: int = 128, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return Workload([[rng.randrange(100, vocab) for _ in range(prompt_len)]], [output_len])


def mixed(vocab: int, num_requests: int = 128, prompt_range=(32, 512), output_range=(16, 256),
          seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def shared_prefix(vocab: int, num_requests: int = 16, prefix_len: int = 1500, question_len: int = 24,
                  seed: int = 0) -> Workload:
    """RAG/agent traffic: one long system prompt, a short different question each, short answers."""
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    prompts = [system + [rng.randrange(100, vocab) for _ in range(question_len)] for _ in range(num_requests)]
    return Workload(prompts, [8] * num_requests)
