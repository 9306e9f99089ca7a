"""`tokenfleet bench gpu`: our engine on a GPU, one model in bf16, against HF generate and the HBM roofline:

1. the card's HBM read bandwidth, measured in this run;
2. batch-1 decode tokens/s (CUDA graphs on) against the roofline: bandwidth / weight bytes per token;
3. `--concurrent` requests (random ~128-token prompts, 128 new tokens, greedy, ignore_eos): output tokens/s of our
   engine with CUDA graphs and with enforce_eager, and of HF transformers `generate` (one left-padded batch), in
   interleaved rounds, with the ratios ours/HF (median, min-max over rounds);
4. on CUDA, the achieved bandwidth of the Triton kernels on Llama-3-8B shapes: paged decode attention, RMSNorm
   with the residual add, SiLU*mul, each as a fraction of the bandwidth of (1).

    tokenfleet bench gpu --model /tmp/llama3-8b-random [--rounds 3] [--concurrent 64] [--json FILE]
    python -m bench.gpu ...        (the same, where no console script is installed: bench/gpu_check.sh)

About 3-4 minutes on an H200 with the Llama-3-8B-shaped random checkpoint (`python -m bench.make_checkpoint`).
A section that fails is reported in the table as "failed: <reason>"; the others still run.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
import traceback
from datetime import UTC, datetime
from importlib import metadata

import torch

from . import hf_peer, host
from .contestants import ours_batch1_tps, ours_mixed
from .engine import weight_bytes_per_token
from .report import add_output_argument, output_path, publish, script_main
from .workloads import Workload, batch1, mixed

# An engine sizes its KV cache to gpu_memory_utilization of the whole card less everything in use on it then
# (memory_profile.kv_cache_budget), the other engine included: so the second engine's figure counts the first's.
# 0.4 and then 0.8 give each engine about 0.4 of the card and leave 0.2 (28 GiB on an H200) for HF's 16 GB model.
UTILIZATION = {"graphs": 0.4, "eager": 0.8}
TARGETS = {"roofline": 0.85, "hf_ratio": 20.0, "paged_decode": 0.70}


def _section(result: dict, name: str, fn, *args) -> None:
    """Runs one section; its failure is recorded (and its traceback printed), not raised."""
    started = time.perf_counter()
    try:
        fn(*args)
    except Exception as exc:
        traceback.print_exc()
        result["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    print(f"[bench.gpu] {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def _llm(engines: dict, mode: str, args):
    """Our engine with CUDA graphs ("graphs", the default) or without ("eager"), built once and kept."""
    if mode not in engines:
        from gpu_worker.engine import LLM

        # Prefix caching off: every round sends the same prompts, and HF recomputes them each time.
        engines[mode] = LLM(str(args.model_dir), dtype="bfloat16", device=args.device, enforce_eager=mode == "eager",
                            enable_prefix_caching=False, gpu_memory_utilization=UTILIZATION[mode],
                            max_num_seqs=args.concurrent)  # graphs for the batches this benchmark makes, no more
    return engines[mode]


def bandwidth(device: torch.device, result: dict) -> None:
    result["hbm_read_gbs"] = host.read_bandwidth_gbs(device)


def batch1_decode(args, device: torch.device, engines: dict, result: dict) -> None:
    llm = _llm(engines, "graphs", args)
    vocab = llm.engine.model_config.vocab_size
    weights = weight_bytes_per_token(llm.engine.runner.model)
    ours_batch1_tps(llm, batch1(vocab, 16, 4, seed=1))  # warm-up
    work = batch1(vocab)
    bandwidth, rates = host.between_bandwidth_readings(lambda: [ours_batch1_tps(llm, work) for _ in range(3)], device)
    tps = statistics.median(rates)
    result.update(weight_bytes_per_token=weights, batch1_tps=tps, batch1_bandwidth_gbs=bandwidth,
                  roofline_tps=bandwidth * 1e9 / weights, batch1_roofline_fraction=tps * weights / (bandwidth * 1e9))


def concurrent(args, device: torch.device, engines: dict, result: dict) -> None:
    graphs, eager = _llm(engines, "graphs", args), _llm(engines, "eager", args)
    n = args.concurrent
    work = mixed(graphs.engine.model_config.vocab_size, n, prompt_range=(112, 144), output_range=(128, 128), seed=2)
    engines["hf"] = hf_peer.load(args.model_dir, torch.bfloat16).to(device)
    runs = {"ours_graphs": lambda w: ours_mixed(graphs, w)["tps"],
            "ours_eager": lambda w: ours_mixed(eager, w)["tps"],
            "hf_generate": lambda w: hf_peer.static_batches_tps(engines["hf"], w, batch_size=n)}
    for run in runs.values():  # warm-up: the same prompts, 4 new tokens
        run(Workload(work.prompts, [4] * n))
    tps = result["concurrent_tps_by_round"] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            tps[name].append(run(work))
    result["concurrent_tps"] = {name: statistics.median(values) for name, values in tps.items()}
    for mode in ("graphs", "eager"):
        ratios = [ours / hf for ours, hf in zip(tps[f"ours_{mode}"], tps["hf_generate"], strict=True)]
        result[f"ratio_{mode}_vs_hf"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _seconds(fn, device: torch.device, iters: int = 20) -> float:
    """Mean seconds per call of `fn` over `iters` calls after two warm-up calls (the first compiles). On CUDA the
    calls are captured in one graph and replayed: launched one by one from Python, a small kernel's figure was the
    launch's cost (rms_norm on 64 rows read as 46 GB/s)."""
    fn()
    fn()
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - started) / iters
    from gpu_worker.engine.cuda_graphs import capture_cuda_graph

    replay = capture_cuda_graph(lambda: [fn() for _ in range(iters)], None)
    replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def paged_decode_gbs(device: torch.device, batch: int, context: int, dtype=torch.bfloat16, heads: int = 32,
                     kv_heads: int = 8, head_dim: int = 128, block: int = 16) -> float:
    """GB/s of context read (the keys and values of every sequence) by `paged_decode`, one query token a row."""
    from gpu_worker.engine.kernels.triton_paged_attention import paged_decode

    per_seq = context // block
    kv_bytes = 2 * batch * context * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    copies = min(16, -(-(256 << 20) // kv_bytes))  # table sets over disjoint blocks in turn: repeats miss L2
    k = torch.randn(copies * batch * per_seq, kv_heads, block, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    tables = torch.arange(copies * batch * per_seq, device=device).view(copies, batch, per_seq)
    lens = torch.full((batch,), context, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    out, turn = torch.empty_like(q), itertools.cycle(range(copies))
    seconds = _seconds(lambda: paged_decode(q, k, v, tables[next(turn)], lens, head_dim**-0.5, out=out), device)
    return kv_bytes / seconds / 1e9


def rms_norm_gbs(device: torch.device, rows: int, hidden: int = 4096, dtype=torch.bfloat16) -> float:
    """GB/s moved by `rms_norm` with the residual: x and the residual in, the output and the sum out, the weight."""
    from gpu_worker.engine.kernels.triton_ops import rms_norm

    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    residual, weight = torch.randn_like(x), torch.ones(hidden, device=device, dtype=dtype)
    return (4 * x.nbytes + weight.nbytes) / _seconds(lambda: rms_norm(x, weight, 1e-5, residual), device) / 1e9


def silu_and_mul_gbs(device: torch.device, rows: int, intermediate: int = 14336, dtype=torch.bfloat16) -> float:
    """GB/s moved by `silu_and_mul`: [rows, 2I] in, [rows, I] out."""
    from gpu_worker.engine.kernels.triton_ops import silu_and_mul

    x = torch.randn(rows, 2 * intermediate, device=device, dtype=dtype)
    return 1.5 * x.nbytes / _seconds(lambda: silu_and_mul(x), device) / 1e9


KERNELS = {
    "paged_decode b1 ctx8192": lambda d: paged_decode_gbs(d, 1, 8192),
    "paged_decode b64 ctx2048": lambda d: paged_decode_gbs(d, 64, 2048),
    "rms_norm+residual [64,4096]": lambda d: rms_norm_gbs(d, 64),
    "rms_norm+residual [2048,4096]": lambda d: rms_norm_gbs(d, 2048),
    "silu_and_mul [2048,28672]": lambda d: silu_and_mul_gbs(d, 2048),
}


def kernel(name: str, device: torch.device, result: dict) -> None:
    gbs = KERNELS[name](device)
    hbm = result.get("hbm_read_gbs")
    result[f"kernel {name}"] = {"gb_s": gbs, "hbm_fraction": gbs / hbm if hbm else None}


def _row(r: dict, section: str, metric: str, key: str, fmt, target: str = "", ok=None) -> tuple:
    if section in r["errors"]:
        return metric, f"failed: {r['errors'][section]}", target, "no" if target else ""
    if key not in r:
        return metric, "skipped", target, ""
    return metric, fmt(r[key]), target, "" if ok is None else ("yes" if ok(r[key]) else "no")


def format_table(r: dict) -> str:
    n, gbs = r["concurrent"], lambda v: f"{v:.0f} GB/s"
    ratio = lambda v: f"{v['median']:.1f}x (min {v['min']:.1f}, max {v['max']:.1f})"  # noqa: E731
    rows = [("metric", "value", "target", "met?"),
            _row(r, "bandwidth", "HBM read bandwidth", "hbm_read_gbs", gbs),
            _row(r, "batch1", "weight bytes per token", "weight_bytes_per_token", lambda v: f"{v / 1e9:.2f} GB"),
            _row(r, "batch1", "batch-1 decode (graphs)", "batch1_tps", lambda v: f"{v:.1f} tok/s"),
            _row(r, "batch1", "batch-1 roofline (bandwidth around the runs)", "roofline_tps",
                 lambda v: f"{v:.1f} tok/s"),
            _row(r, "batch1", "batch-1 fraction of roofline", "batch1_roofline_fraction", lambda v: f"{v:.1%}",
                 f">= {TARGETS['roofline']:.0%}", lambda v: v >= TARGETS["roofline"])]
    for name in ("ours_graphs", "ours_eager", "hf_generate"):
        rows.append(_row(r, "concurrent", f"{n} concurrent: {name} (median)", "concurrent_tps",
                         lambda v, k=name: f"{v[k]:.0f} tok/s"))
    rows.append(_row(r, "concurrent", f"{n} concurrent: ours/HF, graphs", "ratio_graphs_vs_hf", ratio,
                     f">= {TARGETS['hf_ratio']:.0f}x", lambda v: v["median"] >= TARGETS["hf_ratio"]))
    rows.append(_row(r, "concurrent", f"{n} concurrent: ours/HF, eager", "ratio_eager_vs_hf", ratio))
    for name in KERNELS:
        target = f">= {TARGETS['paged_decode']:.0%} of HBM" if name == "paged_decode b64 ctx2048" else ""
        rows.append(_row(r, f"kernel {name}", f"kernel {name}", f"kernel {name}",
                         lambda v: gbs(v["gb_s"]) + (f" = {v['hbm_fraction']:.0%} of HBM" if v["hbm_fraction"] else ""),
                         target, (lambda v: (v["hbm_fraction"] or 0) >= TARGETS["paged_decode"]) if target else None))
    widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
    lines = [" | ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    head = f"bench.gpu: {r['model']} bf16 on {r['device_name']} (torch {r['torch']}, triton {r['triton']}), {r['date']}"
    return "\n".join([head, "", *lines])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="an HF Llama checkpoint directory (or a model name)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrent", type=int, default=64)
    add_output_argument(p, "gpu")


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine.checkpoint import resolve_model_path

    args.model_dir = resolve_model_path(args.model)
    device = torch.device(args.device)
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = None
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "model": args.model,
              "device": args.device, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "torch": torch.__version__, "triton": triton_version, "rounds": args.rounds,
              "concurrent": args.concurrent, "targets": TARGETS, "errors": {}}
    engines: dict = {}
    _section(result, "bandwidth", bandwidth, device, result)
    _section(result, "batch1", batch1_decode, args, device, engines, result)
    _section(result, "concurrent", concurrent, args, device, engines, result)
    engines.clear()  # both engines and the HF model, before the kernels' buffers
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        for name in KERNELS:
            _section(result, f"kernel {name}", kernel, name, device, result)
    return result


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))


if __name__ == "__main__":
    script_main(__doc__, add_arguments, run_from_args)
