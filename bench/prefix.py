"""`tokenfleet bench prefix`: time to first token of requests sharing a long system prompt, with the
engine's prefix caching on and off (same engine, model and prompts, one process, back to back)."""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date

from .report import add_output_argument, output_path, publish
from .workloads import Workload, shared_prefix


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-large")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1500)
    add_output_argument(p, "prefix")


def ttfts(llm, work: Workload) -> list[float]:
    """Each request alone, one after the other: its time from submission to its first token."""
    from gpu_worker.engine import SamplingParams

    engine, out = llm.engine, []
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        started, first = time.perf_counter(), None
        engine.add_request(f"prefix-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        while engine.has_unfinished_requests():
            if engine.step() and first is None:
                first = time.perf_counter() - started
        out.append(first)
    return out


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM

    result = {"date": date.today().isoformat(), "model": args.model, "dtype": args.dtype,
              "prefix_len": args.prefix_len, "num_requests": args.num_requests, "ttft_ms": {}}
    for caching in (False, True):
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, enable_prefix_caching=caching)
        vocab = llm.engine.model_config.vocab_size
        ttfts(llm, shared_prefix(vocab, 2, args.prefix_len, seed=1))  # warm-up on another prefix
        times = ttfts(llm, shared_prefix(vocab, args.num_requests, args.prefix_len))
        # The first request computes the prefix either way; the median is over the ones that could reuse it.
        result["ttft_ms"]["on" if caching else "off"] = {
            "first": times[0] * 1000, "median_rest": statistics.median(times[1:]) * 1000}
        if caching:
            stats = llm.engine.stats()
            result["hit_rate"] = stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"])
        del llm
    on, off = result["ttft_ms"]["on"]["median_rest"], result["ttft_ms"]["off"]["median_rest"]
    result["speedup"] = off / on
    return result


def format_table(r: dict) -> str:
    lines = [f"tokenfleet bench prefix — {r['model']} {r['dtype']}, {r['num_requests']} requests sharing a "
             f"{r['prefix_len']}-token prefix, {r['date']}", "",
             "| prefix caching | TTFT first (ms) | TTFT median of the rest (ms) |", "|---|---:|---:|"]
    for key in ("off", "on"):
        t = r["ttft_ms"][key]
        lines.append(f"| {key} | {t['first']:.1f} | {t['median_rest']:.1f} |")
    lines.append(f"\nmedian TTFT off / on: {r['speedup']:.1f}×; prefix-cache hit rate (tokens): {r['hit_rate']:.0%}")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))
