"""`python -m bench.lab.gemv_plans`: the bf16 GEMV under each way of reading the weights (`GemvPlan`), on a
model's weights.

A decode step of 1-5 rows (batch 1, or a step scoring speculative guesses) reads every weight once through
`gemv_bf16`; how each thread walks its rows (streams a thread, rows prefetched ahead) decides how near the read
bandwidth it gets, and can differ by CPU. Each reading runs every GEMV of the model once, as a step does (from
DRAM where the weights exceed the L3); rounds rotate the plans' order, and each plan's speed is reported against
the engine's plan for this CPU (`GemvPlan.for_cpu`) in the same round. Every plan's outputs are checked equal.

    python -m bench.lab.gemv_plans [--rows 1,2,3,5] [--plans 4x0,2x0,1x2,2x1] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date

import torch

from ..host import describe, read_bandwidth_gbs
from ..report import add_output_argument, in_turn, output_path, publish, script_main, spread


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-large")
    p.add_argument("--rows", default="1,2,3,5", help="rows of x per GEMV, comma-separated (at most 5)")
    p.add_argument("--plans", default="4x0,2x0,1x2,2x1",
                   help="plans as STREAMSxPREFETCH_ROWS, comma-separated; the engine's is always added")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3, help="passes over the weights per reading")
    add_output_argument(p, "gemv-plans")


def _plans(spec: str, own) -> list:
    from gpu_worker.engine.linear import GemvPlan

    plans = [GemvPlan(*map(int, item.split("x"))) for item in spec.split(",") if item]
    return [own] + [p for p in dict.fromkeys(plans) if p != own]


def _label(plan) -> str:
    return f"{plan.streams}x{plan.prefetch_rows}"


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM
    from gpu_worker.engine.checkpoint import resolve_model_path
    from gpu_worker.engine.kernels import cpu_family, cpu_kernels
    from gpu_worker.engine.linear import GemvPlan, Linear

    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("gemv_plans: the bf16 GEMV needs a CPU with AVX512-BF16")
    own = GemvPlan.for_cpu(*cpu_family())
    plans = _plans(args.plans, own)
    llm = LLM(str(resolve_model_path(args.model)), dtype="bfloat16", device="cpu", enable_prefix_caching=False)
    weights = [m.weight for m in llm.engine.runner.model.modules()
               if isinstance(m, Linear) and m.weight is not None and m.weight.shape[1] % 32 == 0]
    if not weights:
        raise SystemExit(f"gemv_plans: {args.model} has no bf16 weights for the GEMV (its linears are quantized)")
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    result = {"date": date.today().isoformat(), "model": args.model, "host": describe(), "own_plan": _label(own),
              "weight_bytes": weight_bytes, "rows": {}}
    for rows in map(int, args.rows.split(",")):
        x = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {w.shape[1] for w in weights}}

        def every_gemv(plan, x=x):
            return [kernels.gemv_bf16(x[w.shape[1]], w, plan.streams, plan.prefetch_rows) for w in weights]

        first = every_gemv(own)
        for plan in plans[1:]:
            if not all(torch.equal(a, b) for a, b in zip(first, every_gemv(plan), strict=True)):
                raise RuntimeError(f"plan {_label(plan)} changed the GEMV's output at {rows} rows")
        seconds: dict[str, list[float]] = {_label(p): [] for p in plans}
        bandwidth = []
        for r in range(args.rounds):
            bandwidth.append(read_bandwidth_gbs(torch.device("cpu"), weight_bytes))
            for plan in in_turn(plans, r):
                started = time.perf_counter()
                for _ in range(args.repeats):
                    every_gemv(plan)
                seconds[_label(plan)].append((time.perf_counter() - started) / args.repeats)
        result["rows"][str(rows)] = {"read_bandwidth_gbs": bandwidth, "seconds": seconds}
        print(f"{rows} rows done", flush=True)
    return result


def format_table(r: dict) -> str:
    own = r["own_plan"]
    lines = [f"bench.lab.gemv_plans — {r['model']}'s {r['weight_bytes'] / 1e6:.0f} MB of bf16 weights, every GEMV "
             f"once a reading, {r['date']}",
             f"host: {r['host']['cpu']}, ISA {' '.join(r['host']['isa'])}, {r['host']['threads']} threads; "
             f"the engine's plan {own} (streams a thread x rows prefetched ahead)", "",
             "| rows | plan | GB/s (median) | of the read bandwidth | speed against the engine's plan: "
             "median [min, max] |",
             "|---:|---|---:|---:|---|"]
    for rows, f in r["rows"].items():
        read = statistics.median(f["read_bandwidth_gbs"])
        base = f["seconds"][own]
        for label, secs in f["seconds"].items():
            gbs = r["weight_bytes"] / statistics.median(secs) / 1e9
            speed = [b / s for b, s in zip(base, secs, strict=True)]
            mark = " (the engine's)" if label == own else ""
            lines.append(f"| {rows} | {label}{mark} | {gbs:.1f} | {100 * gbs / read:.0f} % | "
                         f"{spread(speed)} |")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))


if __name__ == "__main__":
    script_main(__doc__, add_arguments, run_from_args)
