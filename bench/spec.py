"""`tokenfleet bench spec`: speculative decoding on against off, at batch 1 (and larger batches), on one engine.

Each round serves every prompt of a set (greedy; `--batches`: that many requests at once, the set's prompts
repeated to fill a batch) with the n-gram proposer and without it, in alternating order: one engine whose
proposer is switched, because two engines in one process ran up to 1.25x apart by which was created first.
Reports tokens/s both ways, the speedup per round (median [min, max]), the guesses' acceptance rate and the
tokens each target forward produced (1 + kept guesses per step), against the i.i.d. expectation
(1 - a^(k+1)) / (1 - a) at the measured per-guess acceptance a. The prompt sets (`bench/data/spec_prompts.json`):
quote-heavy (passages followed by "quote the sentence that ...", code with "rename x to y") and free chat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

from .report import publish

PROMPTS = Path(__file__).parent / "data" / "spec_prompts.json"


def _serve(llm, prompts: list[str], max_tokens: int, batch: int = 1) -> tuple[float, int, int, int]:
    """(seconds, output tokens, guesses proposed, guesses kept) for the prompts, `batch` at a time."""
    from gpu_worker.engine import SamplingParams

    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=max_tokens)
    guessed, kept = engine.speculation.num_draft_tokens, engine.speculation.num_accepted_tokens
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    if batch > 1:
        chats = [chats[i % len(chats)] for i in range(max(batch, len(chats)))]
    tokens, started = 0, time.perf_counter()
    for i in range(0, len(chats), batch):
        tokens += sum(len(o.token_ids) for o in llm.generate(chats[i:i + batch], params))
    return (time.perf_counter() - started, tokens, engine.speculation.num_draft_tokens - guessed,
            engine.speculation.num_accepted_tokens - kept)


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM
    from gpu_worker.engine.speculative import NgramProposer, NoProposer, SpeculativeConfig

    config = SpeculativeConfig("ngram", args.num_speculative_tokens)
    llm = LLM(args.model, dtype=args.dtype)
    proposers = {"on": NgramProposer(config), "off": NoProposer()}
    sets = json.loads(PROMPTS.read_text())
    result = {"model": args.model, "dtype": args.dtype, "date": str(date.today()), "k": config.num_speculative_tokens,
              "rounds": args.rounds, "sets": {}}
    for name, prompts, batch in [(n, p, b) for n, p in sets.items() for b in map(int, args.batches.split(","))]:
        llm.engine.scheduler.proposer = proposers["on"]
        _serve(llm, prompts[:1], 8)  # warm-up
        runs = {"on": [], "off": []}
        for r in range(args.rounds):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                llm.engine.scheduler.proposer = proposers[mode]
                runs[mode].append(_serve(llm, prompts, args.max_tokens, batch))
        speedups = [(on[1] / on[0]) / (off[1] / off[0]) for on, off in zip(runs["on"], runs["off"], strict=True)]
        guessed, kept = sum(r[2] for r in runs["on"]), sum(r[3] for r in runs["on"])
        tokens = sum(r[1] for r in runs["on"])
        acceptance = kept / guessed if guessed else 0.0
        k = config.num_speculative_tokens
        result["sets"][f"{name}, batch {batch}"] = {
            "tps_on": statistics.median(r[1] / r[0] for r in runs["on"]),
            "tps_off": statistics.median(r[1] / r[0] for r in runs["off"]),
            "speedup": (statistics.median(speedups), min(speedups), max(speedups)),
            "acceptance": acceptance,
            "tokens_per_forward": tokens / (tokens - kept),
            "iid_expectation": (1 - acceptance ** (k + 1)) / (1 - acceptance) if acceptance < 1 else k + 1.0,
        }
    return result


def format_table(r: dict) -> str:
    lines = [f"tokenfleet bench spec — {r['model']} ({r['dtype']}), n-gram k={r['k']}, {r['rounds']} rounds, "
             f"{r['date']}", "",
             "| prompts | tok/s off | tok/s on | speedup, median [min, max] | guesses kept | tokens per forward | "
             "i.i.d. expectation |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in r["sets"].items():
        med, lo, hi = s["speedup"]
        lines.append(f"| {name} | {s['tps_off']:.1f} | {s['tps_on']:.1f} | {med:.2f} [{lo:.2f}, {hi:.2f}] | "
                     f"{s['acceptance']:.0%} | {s['tokens_per_forward']:.2f} | {s['iid_expectation']:.2f} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1", help="requests at once, comma-separated (e.g. 1,8,64)")
    p.add_argument("--json", dest="json_path", default=None)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), args.json_path)
