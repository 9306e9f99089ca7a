"""`tokenfleet bench kv-window`: the KV blocks a sequence holds as it grows past its sliding window, against the same
shape with full attention. One sequence generated to 1x, 2x, 4x and 8x the window, the peak of blocks in use
recorded at each length; the figure is the peak at 8x over the peak at 1x (a window that frees what falls out of it
stays near 1; full attention grows with the length)."""

from __future__ import annotations

import argparse
from datetime import date

from .report import add_output_argument, output_path, publish

MULTIPLES = (1, 2, 4, 8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-sliding", help="a model whose every layer has a sliding window")
    p.add_argument("--full-model", default="tokenfleet-small", help="the same shape with full attention")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    add_output_argument(p, "kv-window")


def peak_blocks(llm, window: int, multiples: tuple[int, ...] = MULTIPLES) -> dict[int, int]:
    """Peak KV blocks in use while one request grows to each multiple of `window` tokens."""
    from gpu_worker.engine import SamplingParams

    engine, peaks = llm.engine, {}
    for m in multiples:
        engine.add_request(f"kv-window-{m}", list(range(1, 17)),
                           SamplingParams(temperature=0.0, max_tokens=m * window - 16, ignore_eos=True))
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv.pool.num_used)
        peaks[m] = peak
    return peaks


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM
    from gpu_worker.engine.checkpoint import open_checkpoint

    window = open_checkpoint(args.model).config.sliding_window
    if window is None:
        raise SystemExit(f"{args.model} has no sliding window")
    result = {"date": date.today().isoformat(), "block_size": args.block_size, "dtype": args.dtype, "window": window,
              "models": {}}
    for name in (args.model, args.full_model):
        llm = LLM(model=name, dtype=args.dtype, block_size=args.block_size, enable_prefix_caching=False,
                  kv_cache_memory_bytes=256 << 20, max_model_len=max(MULTIPLES) * window)
        peaks = peak_blocks(llm, window)
        result["models"][name] = {"peak_blocks": peaks, "ratio_8x_over_1x": peaks[8] / peaks[1]}
        del llm
    return result


def format_table(r: dict) -> str:
    lines = [f"tokenfleet bench kv-window — window {r['window']} tokens, blocks of {r['block_size']}, {r['date']}",
             "", "| model | " + " | ".join(f"peak blocks at {m}x" for m in MULTIPLES) + " | 8x / 1x |",
             "|---|" + "---:|" * (len(MULTIPLES) + 1)]
    for name, m in r["models"].items():
        lines.append(f"| {name} | " + " | ".join(str(m["peak_blocks"][k]) for k in MULTIPLES)
                     + f" | {m['ratio_8x_over_1x']:.2f} |")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))
