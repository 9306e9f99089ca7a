"""Where a decode step's time goes on a GPU: the host's share (scheduling, input building, sampling, output
processing, each timed) against the GPU's (one CUDA-graph replay, timed by events), and the GPU's own time by
kernel (torch.profiler over eager forwards), at batch 1 and at a full bucket of decode rows; then the paged decode
kernel's time per call by split size, over tables as wide as a CUDA graph's (programs past a context exit at once).

    python -m bench.lab.gpu_profile --model /tmp/llama3-8b-random [--rows 64] [--json FILE]

Prints the tables and writes the figures as JSON. About a minute on an H200 with a Llama-3-8B-shaped checkpoint
(`python -m bench.make_checkpoint`).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict

import torch

from ..gpu import _seconds
from ..report import add_output_argument, output_path, publish, script_main
from ..workloads import batch1, mixed


class HostTimers:
    """Wraps named methods of objects so each call's wall time adds up under its name while `counting`; as a
    context manager, takes the wrappers off again on exit."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.wrapped: list[tuple[object, str]] = []
        self.counting = True

    def wrap(self, owner, method: str, name: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.counting:
                    self.seconds[name] += time.perf_counter() - started

        setattr(owner, method, timed)  # an instance attribute, over the class's method
        self.wrapped.append((owner, method))

    def __enter__(self) -> HostTimers:
        return self

    def __exit__(self, *exc) -> None:
        for owner, method in self.wrapped:
            delattr(owner, method)


def _replay_ms(replay, iters: int = 50) -> float:
    """GPU milliseconds of one replay of a captured decode graph, by events over `iters` back-to-back replays."""
    replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _add_greedy(engine, work, prefix: str) -> None:
    from gpu_worker.engine import SamplingParams

    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        engine.add_request(f"{prefix}{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))


def _prefilling(engine) -> bool:
    """Whether the next step holds prompt tokens: a request waits, or a running one's prompt is not all computed."""
    scheduler = engine.scheduler
    return bool(scheduler.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running)


def _steps(engine, work, prefix: str, timers: HostTimers) -> tuple[int, float]:
    """Runs `work` to the end; (decode steps, their wall seconds). Prefill steps are left out, and so are their
    host parts from `timers`."""
    _add_greedy(engine, work, prefix)
    steps, seconds = 0, 0.0
    while engine.has_unfinished_requests():
        timers.counting = decoding = not _prefilling(engine)
        started = time.perf_counter()
        engine.step()
        if decoding:
            steps, seconds = steps + 1, seconds + time.perf_counter() - started
    return steps, seconds


def host_breakdown(llm, rows: int, vocab: int) -> dict:
    """One decode run at `rows` requests: the mean decode step's wall time, its parts on the host, and the GPU
    time of the graph the step replays."""
    engine, runner = llm.engine, llm.engine.runner
    work = (batch1(vocab, 128, 64, seed=3) if rows == 1
            else mixed(vocab, rows, prompt_range=(112, 144), output_range=(64, 64), seed=3))
    _steps(engine, work, "warm", HostTimers())
    with HostTimers() as timers:
        timers.wrap(engine.scheduler, "schedule", "schedule")
        timers.wrap(runner, "prepare", "prepare inputs")
        timers.wrap(runner.graphs, "run", "graph: copy inputs + replay launch")
        timers.wrap(runner, "_sample", "logits + sample (waits for the GPU)")
        timers.wrap(engine.scheduler, "update", "scheduler update")
        timers.wrap(engine, "_process_samples", "outputs (detokenize)")
        steps, seconds = _steps(engine, work, "host", timers)
    bucket = next(b for b in runner.graphs.buckets if b >= rows)
    step_ms = seconds / steps * 1e3
    return {"rows": rows, "decode_steps": steps, "step_ms": step_ms,
            "graph_replay_gpu_ms": _replay_ms(runner.graphs.replays[bucket]),
            "host_ms": {name: s / steps * 1e3 for name, s in timers.seconds.items()}}


def kernel_breakdown(llm, rows: int, vocab: int, top: int = 12) -> list[dict]:
    """GPU time by kernel over eager decode steps of `rows` rows (CUDA graphs set aside for the profile); CPU time
    by op where there is no GPU."""
    from torch.profiler import ProfilerActivity, profile

    from gpu_worker.engine.cuda_graphs import NoDecodeGraphs

    engine, runner, gpu = llm.engine, llm.engine.runner, torch.cuda.is_available()
    graphs, runner.graphs = runner.graphs, NoDecodeGraphs()
    try:
        _add_greedy(engine, mixed(vocab, rows, prompt_range=(112, 144), output_range=(8, 8), seed=4), f"prof{rows}-")
        while _prefilling(engine):
            engine.step()
        engine.step()  # a decode step outside the profile: its kernels compiled
        decode_steps = 0
        with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
            while engine.has_unfinished_requests():
                engine.step()
                decode_steps += 1
        if gpu:
            torch.cuda.synchronize()
    finally:
        runner.graphs = graphs
    spent = (lambda e: e.device_time_total) if gpu else (lambda e: e.self_cpu_time_total)
    events = sorted(prof.key_averages(), key=lambda e: -spent(e))
    total = sum(spent(e) for e in events) or 1.0
    return [{"kernel": e.key[:90], "calls_per_step": e.count / decode_steps,
             "us_per_step": spent(e) / decode_steps, "share": spent(e) / total} for e in events[:top]]


ATTENTION_CASES = [(1, 192), (64, 192), (1, 2048), (64, 2048), (1, 8192)]  # (rows, context)
SPLITS = (64, 128, 256)


def _decode_us(batch: int, context: int, width: int, split: int, kv_heads: int = 8, heads: int = 32,
               head_dim: int = 128, block: int = 16, device: str = "cuda") -> float:
    """Microseconds per `paged_decode` call (bf16, Llama-3-8B's heads) over tables `width` tokens wide."""
    from gpu_worker.engine.kernels.triton_paged_attention import paged_decode

    on, blocks = torch.device(device), width // block
    k = torch.randn(batch * blocks, kv_heads, block, head_dim, device=on, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.arange(batch * blocks, device=on).view(batch, blocks)
    lens = torch.full((batch,), context, device=on)
    q = torch.randn(batch, heads, head_dim, device=on, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    return _seconds(lambda: paged_decode(q, k, v, tables, lens, head_dim**-0.5, out=out, split_tokens=split),
                    on) * 1e6


def attention_splits(width: int = 8192) -> list[dict]:
    """Each case's microseconds per call by split size, over tables as wide as a decode graph's."""
    return [{"rows": batch, "context": context, **{f"split {s}": _decode_us(batch, context, width, s) for s in SPLITS}}
            for batch, context in ATTENTION_CASES]


def format_report(r: dict) -> str:
    lines = [f"bench.lab.gpu_profile: {r['model']} bf16 on {r['device_name']}"]
    for h in r["host"]:
        lines.append(f"\ndecode step at {h['rows']} rows: {h['step_ms']:.2f} ms wall, graph replay on the GPU "
                     f"{h['graph_replay_gpu_ms']:.2f} ms ({h['graph_replay_gpu_ms'] / h['step_ms']:.0%} of the step)")
        lines += [f"  {name:<40} {ms:7.3f} ms" for name, ms in h["host_ms"].items()]
        lines.append(f"  {'the rest of the step':<40} "
                     f"{h['step_ms'] - sum(h['host_ms'].values()) :7.3f} ms")
    for rows, kernels in r["kernels"].items():
        lines.append(f"\nGPU time by kernel, eager decode steps of {rows} rows (us per step, calls per step):")
        lines += [f"  {k['us_per_step']:8.1f} us {k['share']:5.1%} x{k['calls_per_step']:<5.0f} {k['kernel']}"
                  for k in kernels]
    lines.append("\npaged decode, us per call, tables 8192 tokens wide, by tokens per split:")
    lines.append("  rows context " + "".join(f"{'split ' + str(s):>11}" for s in SPLITS))
    lines += [f"  {a['rows']:>4} {a['context']:>7} " + "".join(f"{a[f'split {s}']:>11.1f}" for s in SPLITS)
              for a in r["attention_splits"]]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=64)
    add_output_argument(p, "gpu-profile")


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM

    llm = LLM(args.model, dtype="bfloat16", device="cuda", enable_prefix_caching=False,
              gpu_memory_utilization=0.5, max_num_seqs=args.rows)
    vocab = llm.engine.model_config.vocab_size
    result = {"model": args.model, "device_name": torch.cuda.get_device_name(),
              "host": [host_breakdown(llm, rows, vocab) for rows in (1, args.rows)],
              "kernels": {rows: kernel_breakdown(llm, rows, vocab) for rows in (1, args.rows)}}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    result["attention_splits"] = attention_splits()
    return result


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_report(result), output_path(args))


if __name__ == "__main__":
    script_main(__doc__, add_arguments, run_from_args)
