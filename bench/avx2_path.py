"""`tokenfleet bench avx2`: an AVX2-only host's serving path (no AVX512-BF16: widened-bf16 linears), its native
kernels (`cpu_avx2_kernels.cpp`: the element-wise ops and decode attention) against the torch path they replace,
on any x86 host with AVX2. The engine is made to choose its kernels as on such a host: this process's CPU flags lose
every AVX-512, AMX and AVX-VNNI flag and oneDNN's bf16 packing is not used. torch's own ops keep whatever the CPU
has, so on a CPU with AVX-512 the torch path runs faster than on a real AVX2 one. Both engines live in one process
and take turns, each leading in turn; the ratio native / torch is taken per round (median [min, max]). With
`--peer`, llama.cpp built for an AVX2 host's instruction sets (no AVX-512) runs batch 1 in its own process in the
same rounds, and native / llama.cpp is taken per round too: that host's batch-1 target, measured on this CPU's
memory. On a real AVX2 host, `tokenfleet bench engine --peer llamacpp` gives the figure against the peer."""

from __future__ import annotations

import argparse
import contextlib
import statistics
from datetime import date

# Imported before this process's flags are narrowed: its llama.cpp recipes read the CPU's own.
from . import external_peers
from .host import avx2_host_flags
from .report import in_turn, publish

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
    p.add_argument("--json", dest="json_path", default=None)


def _as_on_an_avx2_host() -> None:
    """The kernel choices of a CPU with AVX2 and FMA but no AVX512-BF16, before any model loads."""
    from gpu_worker.engine import kernels, linear

    flags = avx2_host_flags(kernels.cpu_flags())
    kernels.cpu_flags = lambda: flags
    linear.onednn_packs_bf16 = lambda: False


def _engines(args: argparse.Namespace) -> dict:
    """"native" and "torch" LLMs, each with a function that says whether ops take the native element-wise kernels."""
    from gpu_worker.engine import LLM, kv_cache_format, ops
    from gpu_worker.engine.checkpoint import resolve_model_path

    path, native_ops = str(resolve_model_path(args.model)), ops._native

    def load():
        return LLM(path, dtype="bfloat16", device="cpu", enable_prefix_caching=False,
                   kv_cache_dtype=args.kv_cache_dtype)

    native = load()
    chosen = kv_cache_format.bf16_kernels
    kv_cache_format.bf16_kernels = lambda: None  # the torch attention path
    try:
        torch_path = load()
    finally:
        kv_cache_format.bf16_kernels = chosen
    return {"native": (native, native_ops), "torch": (torch_path, lambda *args, **kwargs: None)}


def run(args: argparse.Namespace) -> dict:
    _as_on_an_avx2_host()
    from gpu_worker.engine import ops
    from gpu_worker.engine.loader import kernel_summary

    from .contestants import ours_batch1_tps, ours_mixed
    from .workloads import batch1, mixed

    engines = _engines(args)
    vocab = engines["native"][0].engine.model_config.vocab_size
    work = {"batch 1": batch1(vocab), "mixed": mixed(vocab, args.num_requests) if args.num_requests else None}
    measure = {"batch 1": lambda llm: ours_batch1_tps(llm, work["batch 1"]),
               "mixed": lambda llm: ours_mixed(llm, work["mixed"])["tps"]}
    workloads = [w for w in WORKLOADS if work[w] is not None]
    for llm, elementwise in engines.values():  # warm-up
        ops._native = elementwise
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
                llm, elementwise = engines[name]
                ops._native = elementwise
                for w in workloads:
                    figures[w][name] = measure[w](llm)
            rounds.append(figures)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        peer_label = peer.label if peer else None
    ops._native = engines["native"][1]
    return {"date": date.today().isoformat(), "model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
            "native": kernel_summary(engines["native"][0].engine.runner.model),
            "torch": kernel_summary(engines["torch"][0].engine.runner.model), "peer": peer_label,
            "peer_error": peer_error, "rounds": rounds, "summary": _summary(rounds)}


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
    lines = [f"tokenfleet bench avx2 — {r['model']} bf16, KV cache {r['kv_cache_dtype']}, {r['date']}, "
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
    return publish(result, format_table(result), args.json_path)
