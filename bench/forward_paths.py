"""`tokenfleet bench forward`: the model runner's ways through the model, in one engine, rounds alternating.

The runner steps through `Transformer.bound()` (each layer's calls bound ahead, no module in between) and lets
only the sampled rows through the last layer's o_proj and MLP. This times, on the same engine and prompts:

- `modules`: every module's call, as `ModelRunner.through_modules()` steps (hooks run there), the sampled rows
  alone through the last layer;
- `bound, every row`: the bound calls, every row through the last layer;
- `bound, sampled rows`: the engine's own.

The first against the third is the bound calls' gain, the second against the third the sampled rows'.

Two workloads: batch-1 decode (`--decode-tokens` tokens after a 128-token prompt: the host's share of a token is
largest there) and one prompt's prefill (`--prompt-len` tokens, one token out). Each path's speed is reported
against the engine's own in the same round (median and spread): the hosts are noisy.

    tokenfleet bench forward [--prompt-len 2000] [--decode-tokens 64] [--rounds 12]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from datetime import date

from .host import describe
from .report import in_turn, publish, spread

ENGINES_OWN = "bound, sampled rows"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-large")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt-len", type=int, default=2000, help="tokens of the prefilled prompt")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded at batch 1 a reading")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--json", dest="json_path", default=None)


def _paths(runner) -> dict:
    """Each path as a context manager that has the runner step through it meanwhile."""
    @contextlib.contextmanager
    def every_row():
        own = runner.forward
        runner.forward = lambda ids, positions, caches, meta, rows=None: own(ids, positions, caches, meta)
        try:
            yield
        finally:
            runner.forward = own

    return {"modules": runner.through_modules, "bound, every row": every_row,
            ENGINES_OWN: contextlib.nullcontext}


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM, SamplingParams
    from gpu_worker.engine.checkpoint import resolve_model_path

    llm = LLM(str(resolve_model_path(args.model)), dtype=args.dtype, device="cpu", enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    decode_prompt = [100 + (i * 7919) % (vocab - 100) for i in range(128)]
    paths = _paths(llm.engine.runner)

    def decode_tps() -> float:
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([decode_prompt], params)
        return args.decode_tokens / (time.perf_counter() - started)

    def prefill_tps(r: int) -> float:  # a fresh prompt each reading, though prefix caching is off
        prompt = [100 + (i * 31 + r * 7919) % (vocab - 100) for i in range(args.prompt_len)]
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        return args.prompt_len / (time.perf_counter() - started)

    decode_tps(), prefill_tps(-1)  # warm-up
    readings: dict[str, dict[str, list[float]]] = {"decode": {}, "prefill": {}}
    names = list(paths)
    for r in range(args.rounds):
        for name in in_turn(names, r):
            with paths[name]():
                readings["decode"].setdefault(name, []).append(decode_tps())
                readings["prefill"].setdefault(name, []).append(prefill_tps(r))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    return {"date": date.today().isoformat(), "model": args.model, "dtype": args.dtype, "host": describe(),
            "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens, "tokens_per_s": readings}


def format_table(r: dict) -> str:
    host = r["host"]
    lines = [f"tokenfleet bench forward — {r['model']} {r['dtype']}, {r['date']}, "
             f"{len(r['tokens_per_s']['decode'][ENGINES_OWN])} rounds",
             f"host: {host['cpu']}, ISA {' '.join(host['isa'])}, {host['threads']} threads", "",
             "| workload | path | tok/s (median) | speed against the engine's own: median [min, max] |",
             "|---|---|---:|---|"]
    workloads = {"decode": f"batch-1 decode, {r['decode_tokens']} tokens",
                 "prefill": f"prefill, one prompt of {r['prompt_len']} tokens"}
    for workload, by_path in r["tokens_per_s"].items():
        own = by_path[ENGINES_OWN]
        for name, tps in by_path.items():
            speed = [t / o for t, o in zip(tps, own, strict=True)]
            mark = " (the engine's)" if name == ENGINES_OWN else ""
            lines.append(f"| {workloads[workload]} | {name}{mark} | {statistics.median(tps):.1f} | "
                         f"{spread(speed)} |")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), args.json_path)
