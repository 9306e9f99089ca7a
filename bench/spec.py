"""`tokenfleet bench spec`: speculative decoding on against off, at batch 1 (and larger batches), on one engine.

Each round serves every prompt of a set (greedy; `--batches`: that many requests at once, the set's prompts
repeated to fill a batch) without guesses and with each proposer (`--methods`: n-gram lookup, a self-int8 or
self-int4 draft), each mode leading a round in turn: one engine per proposer, built with it (`speculative`), whose
scheduler takes turns without it, because two engines in one process ran up to 1.25x apart by which was created
first.
Reports tokens/s each way, the speedup per round (median [min, max]), the guesses' acceptance rate and the
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

from .quant import dense_checkpoint
from .report import add_output_argument, in_turn, output_path, publish

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

    methods = args.methods.split(",")
    if "draft" in methods and not args.draft_model:
        raise SystemExit("method draft needs --draft-model")
    # A self-draft quantizes dense weights: the target is then the model's dense bf16 copy (for every method).
    model = dense_checkpoint(args.model) if any(m.startswith("self-") for m in methods) else args.model
    k = args.num_speculative_tokens
    sets = json.loads(PROMPTS.read_text())
    workloads = [(f"{n}, batch {b}", p, b) for n, p in sets.items() for b in map(int, args.batches.split(","))]
    runs = {}
    for method in methods:
        speculative = {"method": method, "num_speculative_tokens": k}
        if method == "draft":
            speculative["model"] = args.draft_model
        llm = LLM(model, dtype=args.dtype, speculative=speculative)
        for name, prompts, batch in workloads:
            runs[name, method] = _rounds(llm, args, prompts, batch)
        del llm  # one engine at a time
    result = {"model": args.model, "target": model, "draft_model": args.draft_model, "dtype": args.dtype,
              "date": str(date.today()), "k": k, "rounds": args.rounds, "sets": {}}
    for name, _, _ in workloads:
        result["sets"][name] = {
            "tps_off": statistics.median(r[1] / r[0] for m in methods for r in runs[name, m]["off"]),
            "methods": {m: _figures(runs[name, m]["on"], runs[name, m]["off"], k) for m in methods},
        }
    return result


def _rounds(llm, args: argparse.Namespace, prompts: list[str], batch: int) -> dict:
    """The prompts served with the engine's guesses ("on") and without ("off"), taking turns."""
    from gpu_worker.engine.speculative import NoProposer

    proposers = {"off": NoProposer(), "on": llm.engine.scheduler.proposer}
    for proposer in proposers.values():  # warm-up
        llm.engine.scheduler.proposer = proposer
        _serve(llm, prompts[:1], 8)
    runs = {mode: [] for mode in proposers}
    for r in range(args.rounds):
        for mode in in_turn(list(proposers), r):
            llm.engine.scheduler.proposer = proposers[mode]
            runs[mode].append(_serve(llm, prompts, args.max_tokens, batch))
    llm.engine.scheduler.proposer = proposers["on"]
    return runs


def _figures(on: list[tuple], off: list[tuple], k: int) -> dict:
    """A method's throughput, its speedup over the same rounds without guesses, and how many guesses it kept."""
    speedups = [(a[1] / a[0]) / (b[1] / b[0]) for a, b in zip(on, off, strict=True)]
    guessed, kept, tokens = (sum(r[i] for r in on) for i in (2, 3, 1))
    acceptance = kept / guessed if guessed else 0.0
    return {
        "tps": statistics.median(r[1] / r[0] for r in on),
        "speedup": (statistics.median(speedups), min(speedups), max(speedups)),
        "acceptance": acceptance,
        "tokens_per_forward": tokens / (tokens - kept),
        "iid_expectation": (1 - acceptance ** (k + 1)) / (1 - acceptance) if acceptance < 1 else k + 1.0,
    }


def format_table(r: dict) -> str:
    lines = [f"tokenfleet bench spec — {r['model']} ({r['dtype']}, target {Path(r['target']).name}), k={r['k']}, "
             f"{r['rounds']} rounds, {r['date']}", "",
             "| prompts | method | tok/s off | tok/s on | speedup, median [min, max] | guesses kept | "
             "tokens per forward | i.i.d. expectation |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in r["sets"].items():
        for method, f in s["methods"].items():
            med, lo, hi = f["speedup"]
            lines.append(f"| {name} | {method} | {s['tps_off']:.1f} | {f['tps']:.1f} | {med:.2f} [{lo:.2f}, {hi:.2f}] "
                         f"| {f['acceptance']:.0%} | {f['tokens_per_forward']:.2f} | {f['iid_expectation']:.2f} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--methods", default="ngram,self-int8", help="proposers, comma-separated: ngram, draft "
                   "(--draft-model), self-int8, self-int4 (a self-draft's target is the model's dense bf16 copy)")
    p.add_argument("--draft-model", default=None, help="method draft's model (same tokenizer as --model)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1", help="requests at once, comma-separated (e.g. 1,8,64)")
    add_output_argument(p, "spec")


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))
