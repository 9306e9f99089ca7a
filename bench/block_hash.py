"""What collision-resistant prefix-cache keys cost: the engine's SHA-256 block-key chain (block_hash.py) against
the 64-bit chain it replaced (Python's `hash` of (parent hash, block tokens)), on the same prompts, the two
interleaved in rounds; prints microseconds per block for each and the median ratio with its spread.

    python -m bench.block_hash [--prompt-tokens 4096] [--block-size 16] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from gpu_worker.engine.block_hash import block_hashes


def tuple_hash_chain(token_ids: list[int], block_size: int) -> list[int]:
    """The replaced scheme, kept here only as the baseline: each block's id hashes its parent's id and tokens."""
    ids, parent = [], 0
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        ids.append(parent)
    return ids


def _per_block_us(chain, prompts: list[list[int]], block_size: int) -> float:
    started = time.perf_counter()
    blocks = sum(len(chain(prompt, block_size)) for prompt in prompts)
    return (time.perf_counter() - started) / blocks * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(49_152) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    ours, peer = [], []
    for round_ in range(args.rounds):  # alternate which runs first
        pair = [(ours, block_hashes), (peer, tuple_hash_chain)]
        for times, chain in pair if round_ % 2 == 0 else pair[::-1]:
            times.append(_per_block_us(chain, prompts, args.block_size))
    ratios = [o / b for o, b in zip(ours, peer, strict=True)]
    result = {"prompt_tokens": args.prompt_tokens, "block_size": args.block_size, "rounds": args.rounds,
              "sha256_us_per_block": statistics.median(ours), "tuple_hash_us_per_block": statistics.median(peer),
              "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
              "sha256_ms_per_prompt": statistics.median(ours) * (args.prompt_tokens // args.block_size) / 1000}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
