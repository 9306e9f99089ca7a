"""`python -m bench.lab.linear_rates`: each linear's GEMM rate inside the mixed workload, against the same
call made warm.

A mixed run spends most of its time in the projections (three quarters on a Zen 4), so a projection that runs
below its kernel's rate shows here first. This runs `bench engine`'s mixed workload in our engine with a timer
around every linear's kernel, by projection (summed over the layers) and by the rows of the call, and then times
each such call again on its own: the first layer's weight, the bucket's median row count, called back to back so
that the weight is in the caches and oneDNN's primitive exists. A ratio well under 1 says what the run adds to
the kernel: weights from DRAM, a new primitive for each new row count, memory that the allocator maps afresh
(a 4096-token prefill step's gate_up ran at 0.90x here until 0cb1817).

    python -m bench.lab.linear_rates [--num-requests 128] [--prompt-range 32 512] [--output-range 16 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from datetime import date

import torch

from ..host import describe
from ..report import add_output_argument, output_path, publish, script_main
from ..workloads import add_mixed_arguments, mixed_line, mixed_of, mixed_shape

# Rows of a call, as the kernels split them: the GEMV (batch-1 decode, a few guesses), decode steps, prefill steps.
BUCKETS = ((1, 5), (6, 64), (65, 256), (257, 1 << 30))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-large")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add_mixed_arguments(p)
    p.add_argument("--rounds", type=int, default=2, help="timed runs of the workload, after one to warm up")
    add_output_argument(p, "linears")


def _bucket(rows: int) -> str:
    lo, hi = next(b for b in BUCKETS if b[0] <= rows <= b[1])
    return f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+"


class TimedKernel:
    """A linear's kernel with a timer around each call, its seconds and rows recorded under the projection's name."""

    def __init__(self, inner, name: str, calls: dict):
        self.inner, self.name, self.calls = inner, name, calls
        if hasattr(inner, "float32_output"):  # the LM head's path when its kernel has float32 logits
            self.float32_output = lambda x, bias: self._timed(lambda: inner.float32_output(x, bias), x)

    def __call__(self, x: torch.Tensor, weight, bias):
        return self._timed(lambda: self.inner(x, weight, bias), x)

    def _timed(self, call, x: torch.Tensor):
        started = time.perf_counter()
        y = call()
        elapsed, rows = time.perf_counter() - started, x.numel() // x.shape[-1]
        self.calls.setdefault((self.name, _bucket(rows)), []).append((rows, elapsed))
        return y


@contextlib.contextmanager
def timed_linears(model: torch.nn.Module, calls: dict) -> Iterator[dict]:
    """Every `Linear` of `model` timed meanwhile; yields {projection name: its first module}."""
    from gpu_worker.engine.linear import Linear

    linears = [(name.rsplit(".", 1)[-1], m) for name, m in model.named_modules() if isinstance(m, Linear)]
    first = {}
    for name, module in linears:
        first.setdefault(name, module)
        module.kernel = TimedKernel(module.kernel, name, calls)
    try:
        yield first
    finally:
        for _, module in linears:
            module.kernel = module.kernel.inner


def warm_seconds(module, rows: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """One call of `module`'s kernel on `rows` rows, the weight and the primitive warm: the best of `repeats`."""
    x = torch.randn(rows, module.in_features, dtype=dtype)
    for _ in range(2):
        module.kernel(x, module.weight, module.bias)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        module.kernel(x, module.weight, module.bias)
        best = min(best, time.perf_counter() - started)
    return best


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM
    from gpu_worker.engine.checkpoint import resolve_model_path

    from ..contestants import ours_mixed

    llm = LLM(str(resolve_model_path(args.model)), dtype=args.dtype, device="cpu", enable_prefix_caching=False)
    model = llm.engine.runner.model
    shape = mixed_shape(args)
    work = mixed_of(llm.engine.model_config.vocab_size, shape)
    ours_mixed(llm, work)  # warm-up: oneDNN's primitives for the workload's row counts
    rounds = []
    calls: dict = {}
    with timed_linears(model, calls) as first:
        for r in range(args.rounds):
            calls.clear()
            seconds = ours_mixed(llm, work)["seconds"]
            rounds.append({"seconds": seconds, "calls": {k: list(v) for k, v in calls.items()}})
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    rows, round_seconds = [], statistics.median(r["seconds"] for r in rounds)
    order = [_bucket(lo) for lo, _ in BUCKETS]
    for (name, bucket) in sorted(rounds[0]["calls"], key=lambda k: (k[0], order.index(k[1]))):
        module = first[name]
        flop_per_row = 2 * module.in_features * module.out_features
        made = rounds[0]["calls"][(name, bucket)]  # the same calls every round: the same workload, greedy
        seconds = statistics.median(sum(s for _, s in rnd["calls"].get((name, bucket), [])) for rnd in rounds)
        total_rows = sum(n for n, _ in made)
        median_rows = int(statistics.median(n for n, _ in made))
        warm = warm_seconds(module, median_rows, llm.engine.dtype)
        rows.append({"linear": name, "rows": bucket, "calls": len(made), "total_rows": total_rows,
                     "seconds": seconds, "share": seconds / round_seconds,
                     "gflops": total_rows * flop_per_row / seconds / 1e9, "median_rows": median_rows,
                     "warm_gflops": median_rows * flop_per_row / warm / 1e9})
    return {"date": date.today().isoformat(), "model": args.model, "dtype": args.dtype, "host": describe(),
            "mixed_workload": shape,
            "round_seconds": [r["seconds"] for r in rounds], "linears": rows}


def format_table(r: dict) -> str:
    host = r["host"]
    gemm = sum(x["share"] for x in r["linears"])
    lines = [f"bench.lab.linear_rates — {r['model']} {r['dtype']}, {r['date']}, {len(r['round_seconds'])} rounds",
             f"host: {host['cpu']}, ISA {' '.join(host['isa'])}, {host['threads']} threads",
             f"{mixed_line(r['mixed_workload'])}; {statistics.median(r['round_seconds']):.2f} s a round, "
             f"{gemm:.0%} of it in the linears", "",
             "| linear | rows a call | calls | s a round | of the round | GFLOP/s in the run | "
             "GFLOP/s warm (median rows) | run / warm |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for x in r["linears"]:
        lines.append(f"| {x['linear']} | {x['rows']} | {x['calls']} | {x['seconds']:.2f} | {x['share']:.1%} | "
                     f"{x['gflops']:.0f} | {x['warm_gflops']:.0f} ({x['median_rows']}) | "
                     f"{x['gflops'] / x['warm_gflops']:.2f} |")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))


if __name__ == "__main__":
    script_main(__doc__, add_arguments, run_from_args)
