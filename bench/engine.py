"""`tokenfleet bench engine`: our engine and its peers on one model and workload, back to back.

(a) batch 1: decode tokens/s of each and the memory roofline (weight bytes per token / read bandwidth);
(b) mixed: output tokens/s of each and the ratio ours/peer, with our KV use and preemptions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date

import torch

from . import hf_peer
from .report import publish
from .workloads import Workload, batch1, mixed

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-large")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="batch-1 runs; the median is reported")
    p.add_argument("--peer", action="append", default=[], choices=["hf", "hf-cb", "vllm", "llamacpp"],
                   help="peers to run (default: hf and hf-cb)")
    p.add_argument("--skip-mixed", action="store_true")
    p.add_argument("--json", dest="json_path", default=None, help="also write the table as JSON here")


def read_bandwidth_gbs(device: torch.device, gib: float = 1.0, repeats: int = 5) -> float:
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        x.sum().item()
        times.append(time.perf_counter() - started)
    return x.numel() * 4 / statistics.median(times) / 1e9


def _weights(module: torch.nn.Module) -> dict[int, int]:
    """Bytes by storage of the weights `module` serves from: dense parameters, or a quantized layer's kernel
    and table (storages shared with another layer, as a tied LM head's, count once)."""
    found: dict[int, int] = {}

    def add(value, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor) and value.is_mkldnn:  # oneDNN's own layout (a prepacked weight)
            found[id(value)] = value.numel() * value.element_size()
        elif isinstance(value, torch.Tensor):
            found[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
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
    """Every weight is read once per decode step, except the embedding table (one row) when the LM head does
    not share it."""
    head = _weights(model.lm_head)
    table_only = {k: v for k, v in _weights(model.embed_tokens).items() if k not in head}
    return weight_bytes(model) - sum(table_only.values())


def ours_batch1_tps(llm, work: Workload) -> float:
    from gpu_worker.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=work.output_lens[0], ignore_eos=True)
    engine.add_request("bench-b1", work.prompts[0], params)
    first = None
    while engine.has_unfinished_requests():
        if engine.step() and first is None:
            first = time.perf_counter()
    return (work.output_lens[0] - 1) / (time.perf_counter() - first) if work.output_lens[0] > 1 else 0.0


def ours_batch1_against_roofline(llm, work: Workload, device: torch.device, weights: int, repeats: int) -> dict:
    """Each run sits between two bandwidth readings and is compared with their mean: on a shared VM the
    read bandwidth drifts by 2x within minutes, so one reading taken apart from the runs says little."""
    runs = []
    for _ in range(repeats):
        before = read_bandwidth_gbs(device)
        tps = ours_batch1_tps(llm, work)
        bandwidth = (before + read_bandwidth_gbs(device)) / 2
        runs.append((tps, bandwidth, tps * weights / (bandwidth * 1e9)))
    tps, bandwidth, fraction = (statistics.median(column) for column in zip(*runs, strict=True))
    return {"batch1_tps": {"tokenfleet": tps}, "read_bandwidth_gbs": bandwidth,
            "roofline_tps": bandwidth * 1e9 / weights, "batch1_roofline_fraction": fraction}


def ours_mixed(llm, work: Workload) -> dict:
    from gpu_worker.engine import SamplingParams

    engine = llm.engine
    preempted_before = engine.scheduler.num_preemptions
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        engine.add_request(f"bench-m{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    produced, usage = 0, []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        produced += sum(len(c.token_ids) for out in engine.step() for c in out.outputs)
        usage.append(engine.kv.usage)
    elapsed = time.perf_counter() - started
    return {"tps": produced / elapsed, "kv_usage_peak": max(usage), "kv_usage_mean": statistics.mean(usage),
            "preemptions": engine.scheduler.num_preemptions - preempted_before, "seconds": elapsed}


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM
    from gpu_worker.engine.checkpoint import resolve_model_path

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    model_dir = resolve_model_path(args.model)
    peers = args.peer or ["hf", "hf-cb"]
    llm = LLM(str(model_dir), dtype=args.dtype.replace("bf16", "bfloat16").replace("fp32", "float32"),
              device=args.device)
    vocab = llm.engine.model_config.vocab_size
    b1, mix = batch1(vocab), mixed(vocab, args.num_requests)
    weights = weight_bytes_per_token(llm.engine.runner.model)
    result = {"date": date.today().isoformat(), "model": args.model, "dtype": args.dtype, "device": args.device,
              "threads": torch.get_num_threads(), "weight_bytes": weights, "batch1_tps": {}, "mixed_tps": {}}
    ours_batch1_tps(llm, batch1(vocab, 16, 4, seed=1))  # warm-up
    result.update(ours_batch1_against_roofline(llm, b1, device, weights, args.repeats))
    if not args.skip_mixed:
        m = ours_mixed(llm, mix)
        result["mixed_tps"]["tokenfleet"] = m["tps"]
        result.update(kv_usage_peak=m["kv_usage_peak"], kv_usage_mean=m["kv_usage_mean"],
                      preemptions=m["preemptions"])
    del llm
    if {"hf", "hf-cb"} & set(peers):
        _run_hf(model_dir, dtype, peers, b1, mix, args, result)
    for peer in {"vllm", "llamacpp"} & set(peers):
        from . import external_peers

        external_peers.run(peer, model_dir, args, b1, mix, result)
    return result


def _run_hf(model_dir, dtype, peers, b1: Workload, mix: Workload, args, result: dict) -> None:
    model = hf_peer.load(model_dir, dtype).to(args.device)
    if "hf" in peers:
        result["batch1_tps"]["hf-generate"] = statistics.median(
            hf_peer.batch1_decode_tps(model, b1) for _ in range(args.repeats))
        if not args.skip_mixed:
            result["mixed_tps"]["hf-generate (static 16)"] = hf_peer.static_batches_tps(model, mix)
    if "hf-cb" in peers and not args.skip_mixed:
        try:
            result["mixed_tps"]["hf-generate_batch (continuous)"] = hf_peer.continuous_batching_tps(model, mix)
        except Exception as exc:  # a peer's failure is reported, not fatal to the benchmark
            result.setdefault("peer_errors", {})["hf-cb"] = f"{type(exc).__name__}: {exc}"


def format_table(r: dict) -> str:
    lines = [f"tokenfleet bench engine — {r['model']} {r['dtype']} on {r['device']} ({r['threads']} threads), "
             f"{r['date']}",
             f"read bandwidth {r['read_bandwidth_gbs']:.1f} GB/s (median), "
             f"weights/token {r['weight_bytes'] / 1e6:.0f} MB, roofline {r['roofline_tps']:.0f} tok/s", "",
             "| workload | engine | tok/s | tokenfleet / engine |", "|---|---|---:|---:|"]
    for key, label in (("batch1_tps", "batch 1 decode"), ("mixed_tps", "mixed")):
        ours = r[key].get("tokenfleet")
        for name, tps in r[key].items():
            ratio = "—" if name == "tokenfleet" or not ours or not tps else f"{ours / tps:.2f}×"
            lines.append(f"| {label} | {name} | {tps:.1f} | {ratio} |")
    lines.append(f"\nbatch-1 fraction of roofline (median over runs, each against the bandwidth read around it): "
                 f"{r['batch1_roofline_fraction']:.0%}")
    if "kv_usage_peak" in r:
        lines.append(f"mixed: KV usage peak {r['kv_usage_peak']:.0%}, mean {r['kv_usage_mean']:.0%}, "
                     f"preemptions {r['preemptions']}")
    for peer, err in r.get("peer_errors", {}).items():
        lines.append(f"peer {peer} failed: {err}")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), args.json_path)
