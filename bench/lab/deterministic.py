"""`python -m bench.lab.deterministic`: what batch-invariant mode (`deterministic=True`) costs against the default
kernels, on one model: decode tokens/s at batch 1 and at `--batch`, and the time of one `--prefill-len`-token
prefill. Both engines live in one process and take turns, each leading every other round (which engine was
created first moved figures by up to 1.25x); the ratio deterministic / default is taken per round and reported
as median [min, max], so it never compares halves that ran minutes apart."""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date

from ..report import add_output_argument, output_path, publish, script_main

WORKLOADS = ("decode b1", "decode bN", "prefill")


def _decode_tok_s(llm, batch: int, max_tokens: int) -> float:
    from gpu_worker.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[1 + (7 * i + j) % 500 for j in range(16)] for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))  # the prompts' prefill, untimed
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)


def _prefill_s(llm, length: int, round_: int) -> float:
    from gpu_worker.engine import SamplingParams

    prompt = [1 + (round_ * 31 + j) % 900 for j in range(length)]  # a new prompt each round: no prefix hit
    started = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - started


def _measure(llm, args: argparse.Namespace, round_: int) -> dict[str, float]:
    """Per workload, a figure where larger is slower (seconds per token, seconds)."""
    return {"decode b1": 1 / _decode_tok_s(llm, 1, args.max_tokens),
            "decode bN": 1 / _decode_tok_s(llm, args.batch, args.max_tokens),
            "prefill": _prefill_s(llm, args.prefill_len, round_)}


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM

    engines = {"default": LLM(args.model, dtype=args.dtype),
               "deterministic": LLM(args.model, dtype=args.dtype, deterministic=True)}
    for llm in engines.values():  # warm-up: kernels' first calls, allocator
        _measure(llm, args, -1)
    rounds = []
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        rounds.append({name: _measure(engines[name], args, r) for name in order})
    figures = {}
    for w in WORKLOADS:
        ratios = [x["deterministic"][w] / x["default"][w] for x in rounds]
        figures[w] = {"default": statistics.median(x["default"][w] for x in rounds),
                      "deterministic": statistics.median(x["deterministic"][w] for x in rounds),
                      "ratio": (statistics.median(ratios), min(ratios), max(ratios))}
    return {"model": args.model, "dtype": args.dtype, "batch": args.batch, "max_tokens": args.max_tokens,
            "prefill_len": args.prefill_len, "rounds": args.rounds, "date": str(date.today()), "figures": figures}


def format_table(result: dict) -> str:
    rows = [f"{result['model']} {result['dtype']}, {result['rounds']} rounds, {result['date']}",
            "| workload | default | deterministic | time ratio, median [min, max] |", "|---|---|---|---|"]
    names = {"decode b1": "decode, batch 1", "decode bN": f"decode, batch {result['batch']}",
             "prefill": f"prefill, {result['prefill_len']} tokens"}
    for w, f in result["figures"].items():
        if w == "prefill":
            cells = f"{f['default'] * 1000:.1f} ms | {f['deterministic'] * 1000:.1f} ms"
        else:
            cells = f"{1 / f['default']:.1f} tok/s | {1 / f['deterministic']:.1f} tok/s"
        median, low, high = f["ratio"]
        rows.append(f"| {names[w]} | {cells} | {median:.2f} [{low:.2f}, {high:.2f}] |")
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-small")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    add_output_argument(p, "deterministic")


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))


if __name__ == "__main__":
    script_main(__doc__, add_arguments, run_from_args)
