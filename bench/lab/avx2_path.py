"""`python -m bench.lab.avx2_path`: an AVX2-only host's serving path (no AVX512-BF16: widened-bf16 linears), its
native kernels (`cpu_avx2_kernels.cpp`: the element-wise ops and decode attention) against the torch path they
replace, on any x86 host with AVX2.

Both engines choose their kernels as on such a host (`EngineConfig.cpu_isa="avx2"`: no AVX-512, AMX or AVX-VNNI,
and oneDNN's bf16 packing unused); the second takes the torch references for the element-wise ops and attention
(`torch_ops=True`). torch's own ops keep whatever the CPU has, so on a CPU with AVX-512 the torch path runs faster
than on a real AVX2 one. Both engines live in one process and take turns, each leading in turn; the ratio
native / torch is taken per round (median [min, max]). With `--peer`, llama.cpp built for an AVX2 host's
instruction sets (no AVX-512) runs batch 1 in its own process in the same rounds, and native / llama.cpp is taken
per round too: that host's batch-1 target, measured on this CPU's memory. On a real AVX2 host,
`tokenfleet bench engine --peer llamacpp` gives the figure against the peer.

    python -m bench.lab.avx2_path [--kv-cache-dtype int8] [--rounds 4] [--num-requests 32] [--peer]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from datetime import date

from .. import external_peers
from ..report import add_output_argument, in_turn, output_path, publish, script_main

WORKLOADS = ("batch 1", "mixed")
PEER = "llamacpp-avx2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-large")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=32, help="of the mixed workload (0: batch 1 only)")
    p.add_argument("--peer", action="store_true",
                   help="llama.cpp built for an AVX2 host (its own environment, made on first use) runs batch 1 in "
                        "each round too")
    add_output_argument(p, "avx2-path")


def _engines(args: argparse.Namespace) -> dict:
    """The "native" and "torch" LLMs, both choosing their kernels as on an AVX2 host."""
    from gpu_worker.engine import LLM
    from gpu_worker.engine.checkpoint import resolve_model_path

    path = str(resolve_model_path(args.model))
    return {name: LLM(path, dtype="bfloat16", device="cpu", enable_prefix_caching=False, cpu_isa="avx2",
                      torch_ops=name == "torch", kv_cache_dtype=args.kv_cache_dtype)
            for name in ("native", "torch")}


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine.kernel_choice import kernel_summary

    from ..contestants import ours_batch1_tps, ours_mixed
    from ..workloads import batch1, mixed

    engines = _engines(args)
    vocab = engines["native"].engine.model_config.vocab_size
    work = {"batch 1": batch1(vocab), "mixed": mixed(vocab, args.num_requests) if args.num_requests else None}
    measure = {"batch 1": lambda llm: ours_batch1_tps(llm, work["batch 1"]),
               "mixed": lambda llm: ours_mixed(llm, work["mixed"])["tps"]}
    workloads = [w for w in WORKLOADS if work[w] is not None]
    for llm in engines.values():  # warm-up
        ours_batch1_tps(llm, batch1(vocab, 16, 4, seed=1))
    with contextlib.ExitStack() as stack:
        peer, peer_error = _start_peer(stack, args, work["batch 1"]) if args.peer else (None, None)
        rounds = []
        for r in range(args.rounds):
            figures = {w: {} for w in workloads}
            for name in in_turn(["native", "torch", PEER] if peer else ["native", "torch"], r):
                if name == PEER:
                    figures["batch 1"][PEER] = statistics.median(peer.measure("batch1"))
                    continue
                for w in workloads:
                    figures[w][name] = measure[w](engines[name])
            rounds.append(figures)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        peer_label = peer.label if peer else None
    summaries = {name: kernel_summary(llm.engine.runner.model, llm.engine.kernels) for name, llm in engines.items()}
    return {"date": date.today().isoformat(), "model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
            **summaries, "peer": peer_label, "peer_error": peer_error, "rounds": rounds, "summary": _summary(rounds)}


def _start_peer(stack: contextlib.ExitStack, args: argparse.Namespace, b1) -> tuple:
    """(the llama.cpp peer, None), or (None, why it did not start): ours are measured either way."""
    from gpu_worker.engine.checkpoint import resolve_model_path

    try:
        return stack.enter_context(external_peers.start(PEER, resolve_model_path(args.model), "bf16", b1, None)), None
    except external_peers.PeerError as exc:
        print(f"{PEER}: {exc}", flush=True)
        return None, str(exc)


def _summary(rounds: list[dict]) -> dict:
    """Per workload: each contestant's median, and native / torch (and native / peer) per round: median [min, max]."""
    summary = {}
    for w in rounds[0]:
        summary[w] = {name: statistics.median(f[w][name] for f in rounds) for name in rounds[0][w]}
        for key, other in (("ratio", "torch"), ("peer_ratio", PEER)):
            if other in rounds[0][w]:
                ratios = [f[w]["native"] / f[w][other] for f in rounds]
                summary[w].update({key: statistics.median(ratios), f"{key}_min": min(ratios),
                                   f"{key}_max": max(ratios)})
    return summary


def format_table(r: dict) -> str:
    lines = [f"bench.lab.avx2_path — {r['model']} bf16, KV cache {r['kv_cache_dtype']}, {r['date']}, "
             f"{len(r['rounds'])} rounds, kernels chosen as on an AVX2 host",
             f"native: {r['native']}", f"torch:  {r['torch']}"]
    peer = r.get("peer")
    if peer:
        lines.append(f"peer:   {peer}, batch 1 only")
    elif r.get("peer_error"):
        lines.append(f"peer:   did not run: {r['peer_error']}")
    lines += ["", "| workload | native tok/s | torch path tok/s | native / torch: median [min, max] |"
              + (" peer tok/s | native / peer: median [min, max] |" if peer else ""),
              "|---|---:|---:|---|" + ("---:|---|" if peer else "")]
    for w, s in r["summary"].items():
        line = (f"| {w} | {s['native']:.1f} | {s['torch']:.1f} | "
                f"{s['ratio']:.2f}x [{s['ratio_min']:.2f}, {s['ratio_max']:.2f}] |")
        if peer:
            line += (f" {s[PEER]:.1f} | {s['peer_ratio']:.2f}x [{s['peer_ratio_min']:.2f}, {s['peer_ratio_max']:.2f}] |"
                     if PEER in s else " — | — |")
        lines.append(line)
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))


if __name__ == "__main__":
    script_main(__doc__, add_arguments, run_from_args)
