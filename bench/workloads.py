"""Benchmark workloads, fixed by seed so every peer gets the same prompts and output lengths."""

from __future__ import annotations

import argparse
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


def add_mixed_arguments(p: argparse.ArgumentParser) -> None:
    """The mixed workload's shape on a benchmark's command line."""
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-range", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"),
                   help="the mixed workload's prompt lengths, drawn uniformly (equal bounds: prefill-light loads)")
    p.add_argument("--output-range", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"),
                   help="its output lengths (1 1: the prompts' prefill alone)")


def mixed_shape(args: argparse.Namespace) -> dict:
    """The shape `add_mixed_arguments` read, as a benchmark's JSON records it."""
    return {"requests": args.num_requests, "prompt_range": list(args.prompt_range),
            "output_range": list(args.output_range)}


def mixed_of(vocab: int, shape: dict) -> Workload:
    return mixed(vocab, shape["requests"], tuple(shape["prompt_range"]), tuple(shape["output_range"]))


def mixed_line(shape: dict) -> str:
    """The shape as a benchmark's table says it."""
    (p0, p1), (o0, o1) = shape["prompt_range"], shape["output_range"]
    return f"mixed workload: {shape['requests']} requests at once, prompts of {p0}-{p1} tokens, {o0}-{o1} out"


def shared_prefix(vocab: int, num_requests: int = 16, prefix_len: int = 1500, question_len: int = 24,
                  seed: int = 0) -> Workload:
    """RAG/agent traffic: one long system prompt, a short different question each, short answers."""
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    prompts = [system + [rng.randrange(100, vocab) for _ in range(question_len)] for _ in range(num_requests)]
    return Workload(prompts, [8] * num_requests)
