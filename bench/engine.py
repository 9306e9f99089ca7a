"""`tokenfleet bench engine`: our engine against its peers on one model and workload, in interleaved rounds.

Workloads (fixed seed, greedy, `ignore_eos`): batch 1, decode tokens/s of one 128-token prompt and 128 new tokens
(the median of `--repeats` runs); mixed, output tokens/s of 128 requests with uneven prompts and outputs, all
submitted at once (`--prompt-range` and `--output-range` reshape it: `--output-range 1 1` times the prompts'
prefill alone, `--prompt-range 32 32 --output-range 256 256` mostly decode, so that a mixed ratio can be split in
two). Every engine is loaded once, with prefix caching off (each round repeats the prompts, which a cache would
serve from the second round on). Each round then runs, for every peer and workload, ours and the peer back to back
(ours first in odd rounds, the peer first in even ones), so that each ratio compares two runs seconds apart: on a
shared host a neighbour's load during one half of a run minutes long moved a ratio by 1.4x. The table gives each
ratio's median over the rounds and its spread, the host (CPU, ISA, L3, threads) and the read bandwidth of each
round, over 1 GiB and over the weights' size (the latter close to the former: the weights stream from DRAM; far
above it: from cache). Batch 1 is also set against the memory roofline: weight bytes read per token over the
bandwidth read just before and after the runs. The figures' picture (bench/plots.py) is written beside their JSON.
"""

from __future__ import annotations

import argparse
import statistics
from datetime import date
from pathlib import Path

import torch

from gpu_worker.engine.moe import SparseMoE

from . import external_peers, hf_peer, host
from .contestants import BATCH1, MIXED, HfContinuousBatching, HfGenerate, Ours, OursOnAnotherModel, ours_batch1_tps
from .report import add_output_argument, output_path, publish
from .workloads import Workload, add_mixed_arguments, batch1, mixed_line, mixed_of, mixed_shape

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PEERS = ("hf", "hf-cb", "vllm", "llamacpp", "twin")
DEFAULT_MODEL = "tokenfleet-large"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a model name or path; tokenfleet-moe: a mixture of experts whose active parameters are "
                        f"{DEFAULT_MODEL}'s (results of other models than {DEFAULT_MODEL} go to their own file)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    add_mixed_arguments(p)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of ours and each peer in turn; a ratio is their median")
    p.add_argument("--repeats", type=int, default=3, help="batch-1 runs per engine and round; the median counts")
    p.add_argument("--peer", action="append", default=[], choices=PEERS, help="peers to run (default: hf)")
    p.add_argument("--skip-mixed", action="store_true")
    p.add_argument("--twin", default=DEFAULT_MODEL,
                   help="the model `--peer twin` runs on our engine (a mixture's dense twin)")
    add_output_argument(p, "engine")


def _weights(module: torch.nn.Module) -> dict[int, int]:
    """Bytes by address of the weights `module` serves from: dense parameters, or a quantized layer's kernel
    and table (a tensor shared with another layer, as a tied LM head's, counts once)."""
    found: dict[int, int] = {}

    def add(value, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor) and value.is_mkldnn:  # oneDNN's own layout (a prepacked weight)
            found[id(value)] = value.numel() * value.element_size()
        elif isinstance(value, torch.Tensor):  # by address: the weights may be views of one huge-page buffer
            found[value.data_ptr()] = value.numel() * value.element_size()
        elif depth < 2 and hasattr(value, "__dict__"):
            for item in vars(value).values():
                add(item, depth + 1)

    for m in module.modules():
        for p in m.parameters(recurse=False):
            add(p)
        if getattr(m, "weight", True) is None:  # quantized: the kernel (or the table) holds the weight
            add(getattr(m, "kernel", None))
            add(getattr(m, "quantized", None))
    return found


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(_weights(model).values())


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Every weight is read once per batch-1 decode step, except the embedding table (one row) when the LM head
    does not share it, and in a mixture of experts all but the token's k experts."""
    head = _weights(model.lm_head)
    table_only = {k: v for k, v in _weights(model.embed_tokens).items() if k not in head}
    unread = sum(sum(weight_bytes(expert) for expert in moe.experts) * (1 - moe.top_k / len(moe.experts))
                 for moe in model.modules() if isinstance(moe, SparseMoE))
    return weight_bytes(model) - sum(table_only.values()) - int(unread)


def _peers(names: list[str], model_dir, dtype: str, b1: Workload, mix: Workload, device: str, errors: dict,
           twin_model: str) -> list:
    """The peers that could be loaded; why each other one could not is recorded in `errors`."""
    peers = []
    if {"hf", "hf-cb"} & set(names):
        model = hf_peer.load(model_dir, DTYPES[dtype]).to(device)
        peers += [cls(model, b1, mix) for name, cls in (("hf", HfGenerate), ("hf-cb", HfContinuousBatching))
                  if name in names]
    if "twin" in names:
        peers.append(OursOnAnotherModel(our_engine(twin_model, dtype, device), twin_model, b1, mix))
    for name in ("vllm", "llamacpp"):
        if name in names:
            try:
                peers.append(external_peers.start(name, model_dir, dtype, b1, mix))
            except external_peers.PeerError as exc:
                errors[name] = str(exc)
    return peers


def _measure(engine, workload: str, repeats: int, weights: int, device: torch.device) -> dict:
    """One engine's figure for a workload in a round; batch 1 sits between two bandwidth readings."""
    if workload == MIXED:
        return {"tps": engine.measure(MIXED)}
    bandwidth, rates = host.between_bandwidth_readings(lambda: engine.measure(BATCH1, repeats), device)
    tps = statistics.median(rates)
    return {"tps": tps, "bandwidth_gbs": bandwidth, "roofline_fraction": tps * weights / (bandwidth * 1e9)}


def _pair(order: list, ours, workload: str, repeats: int, weights: int, device: torch.device,
          errors: dict) -> dict | None:
    """Each engine's figure, in order; None when the peer failed (why is recorded in `errors`). Ours' failure is
    the benchmark's."""
    figures = {}
    for engine in order:
        if engine is ours:
            figures[engine.label] = _measure(engine, workload, repeats, weights, device)
            continue
        try:
            figures[engine.label] = _measure(engine, workload, repeats, weights, device)
        except Exception as exc:  # noqa: BLE001 - a peer's failure is reported, not fatal to the benchmark
            errors[engine.label] = f"{type(exc).__name__}: {exc}"
            return None
    return figures


def interleave(ours, peers: list, workloads: list[str], args, weights: int, device: torch.device,
               errors: dict) -> list[dict]:
    """Per round: its bandwidth readings and, for each peer and workload, ours and the peer back to back. A peer
    that fails is recorded in `errors` and leaves the rounds."""
    rounds = []
    for r in range(args.rounds):
        pairs = []
        for peer in list(peers) or [None]:
            for workload in workloads:
                if peer is not None and workload not in peer.workloads:
                    continue
                order = [ours] if peer is None else [ours, peer] if r % 2 == 0 else [peer, ours]
                figures = _pair(order, ours, workload, args.repeats, weights, device, errors)
                if figures is None:  # the peer failed: reported, and the other peers' rounds go on
                    peers.remove(peer)
                    break
                pairs.append({"workload": workload, "order": [e.label for e in order], "figures": figures})
        rounds.append({"read_bandwidth_gbs": host.read_bandwidth_gbs(device),
                       "read_bandwidth_weights_gbs": host.read_bandwidth_gbs(device, weights), "pairs": pairs})
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    return rounds


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def summarize(rounds: list[dict]) -> dict:
    """Each engine's median tokens/s per workload, ours' batch-1 roofline fraction, and each peer's ratio
    (ours / peer within a pair) with its spread over the rounds."""
    tps: dict[str, dict[str, list]] = {BATCH1: {}, MIXED: {}}
    ratios: dict[str, dict[str, list]] = {BATCH1: {}, MIXED: {}}
    fractions: dict[str, list] = {}
    for rnd in rounds:
        for pair in rnd["pairs"]:
            figures = pair["figures"]
            for label, f in figures.items():
                tps[pair["workload"]].setdefault(label, []).append(f["tps"])
                if "roofline_fraction" in f:
                    fractions.setdefault(label, []).append(f["roofline_fraction"])
            for label, f in figures.items():
                if label != Ours.label:
                    ratios[pair["workload"]].setdefault(label, []).append(figures[Ours.label]["tps"] / f["tps"])
    return {"batch1_tps": {k: statistics.median(v) for k, v in tps[BATCH1].items()},
            "mixed_tps": {k: statistics.median(v) for k, v in tps[MIXED].items()},
            "ratios": {w: {k: spread(v) for k, v in by_peer.items()} for w, by_peer in ratios.items() if by_peer},
            "roofline_fraction": {k: statistics.median(v) for k, v in fractions.items()}}


def our_engine(model: str, dtype: str, device: str):
    """Our engine on `model` as the benchmark runs it: `dtype` by its short name, no prefix caching."""
    from gpu_worker.engine import LLM

    return LLM(model, dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype], device=device, enable_prefix_caching=False)


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine.checkpoint import resolve_model_path

    device = torch.device(args.device)
    model_dir = resolve_model_path(args.model)
    llm = our_engine(str(model_dir), args.dtype, args.device)
    vocab = llm.engine.model_config.vocab_size
    shape = mixed_shape(args)
    b1, mix = batch1(vocab), mixed_of(vocab, shape)
    weights = weight_bytes_per_token(llm.engine.runner.model)
    ours_batch1_tps(llm, batch1(vocab, 16, 4, seed=1))  # warm-up
    result = {"date": date.today().isoformat(), "model": args.model, "dtype": args.dtype, "device": args.device,
              "host": host.describe(), "weight_bytes": weights, "rounds_run": args.rounds, "peer_errors": {},
              "mixed_workload": shape}
    ours = Ours(llm, b1, mix)
    peers = _peers(args.peer or ["hf"], model_dir, args.dtype, b1, mix, args.device, result["peer_errors"],
                   args.twin)
    opened = list(peers)
    try:
        rounds = interleave(ours, peers, [BATCH1] + ([] if args.skip_mixed else [MIXED]), args, weights, device,
                            result["peer_errors"])
    finally:
        for peer in opened:
            peer.close()
    result.update(summarize(rounds), rounds=rounds)
    if ours.mixed_runs:
        runs = ours.mixed_runs
        result.update(kv_usage_peak=max(m["kv_usage_peak"] for m in runs),
                      kv_usage_mean=statistics.mean(m["kv_usage_mean"] for m in runs),
                      preemptions=sum(m["preemptions"] for m in runs))
    return result


def format_table(r: dict) -> str:
    lines = [f"tokenfleet bench engine — {r['model']} {r['dtype']} on {r['device']}, {r['date']}, "
             f"{r['rounds_run']} interleaved rounds", host.describe_line(r["host"], r["weight_bytes"]),
             mixed_line(r["mixed_workload"]),
             "read bandwidth per round, GB/s (over 1 GiB / over the weights' size): " + ", ".join(
                 f"{rnd['read_bandwidth_gbs']:.1f} / {rnd['read_bandwidth_weights_gbs']:.1f}" for rnd in r["rounds"]),
             "", "| workload | engine | tok/s (median) | tokenfleet / engine: median | spread over rounds |",
             "|---|---|---:|---:|---|"]
    for workload, key, label in ((BATCH1, "batch1_tps", "batch 1 decode"), (MIXED, "mixed_tps", "mixed")):
        for name, tps in r[key].items():
            ratio = r["ratios"].get(workload, {}).get(name)
            cells = ("—", "—") if ratio is None else (
                f"{ratio['median']:.2f}×", f"{ratio['min']:.2f}–{ratio['max']:.2f}× "
                                           f"({', '.join(f'{v:.2f}' for v in ratio['values'])})")
            lines.append(f"| {label} | {name} | {tps:.1f} | {cells[0]} | {cells[1]} |")
    lines.append("\nbatch-1 fraction of the read roofline (median over rounds, each run against the bandwidth read "
                 "around it): " + ", ".join(f"{k} {v:.0%}" for k, v in r["roofline_fraction"].items()))
    if "hf-generate" in r["mixed_tps"]:
        lines.append("hf-generate runs the mixed workload in static batches of 16, each to its longest output")
    if "kv_usage_peak" in r:
        lines.append(f"mixed (ours): KV usage peak {r['kv_usage_peak']:.0%}, mean {r['kv_usage_mean']:.0%}, "
                     f"preemptions {r['preemptions']}")
    for peer, err in r["peer_errors"].items():
        lines.append(f"peer {peer} failed: {err}")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    variant = None if args.model == DEFAULT_MODEL else Path(args.model).name.removesuffix(".gguf")
    return publish(result, format_table(result), output_path(args, variant), picture=True)
