"""`tokenfleet bench kv-window`: the KV memory a sequence holds as it grows past its sliding window. One sequence
generated to 1x, 2x, 4x and 8x the window, the peak of KV memory in use recorded at each length, for a model whose
every layer slides, a hybrid (Gemma 3's five sliding layers to one full one, each kind with block tables of its
own: `kv_cache_groups.py`) and the same shape with full attention.

Memory is counted in layer-blocks: one block of one layer's keys and values. A block id reserves one in each of
its KV-cache layout's slots (every layer's, for a model of one group). Figures: the sliding model's peak at 8x over
its peak at 1x (target <= 1.25); the hybrid's peak at 8x over its bound, a block for every 16 tokens in each full
layer plus, in each sliding layer, the blocks one window spans (target <= 1)."""

from __future__ import annotations

import argparse
from datetime import date

from .report import add_output_argument, output_path, publish

MULTIPLES = (1, 2, 4, 8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-sliding", help="a model whose every layer has a sliding window")
    p.add_argument("--hybrid-model", default="tokenfleet-hybrid", help="a model with sliding and full layers")
    p.add_argument("--full-model", default="tokenfleet-small", help="the same shape with full attention")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    add_output_argument(p, "kv-window")


def peak_layer_blocks(llm, window: int, multiples: tuple[int, ...] = MULTIPLES) -> dict[int, int]:
    """Peak KV layer-blocks in use while one request grows to each multiple of `window` tokens."""
    from gpu_worker.engine import SamplingParams

    engine, peaks = llm.engine, {}
    for m in multiples:
        engine.add_request(f"kv-window-{m}", list(range(1, 17)),
                           SamplingParams(temperature=0.0, max_tokens=m * window - 16, ignore_eos=True))
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv.pool.num_used)
        peaks[m] = peak * engine.kv_layout.num_slots
    return peaks


def hybrid_bound(config, length: int, block_size: int) -> int:
    """Layer-blocks a sequence of `length` tokens needs at most: all of them in each full layer, one window's in
    each sliding layer (the blocks `window` tokens span, unaligned)."""
    windows = [config.window_of(i) for i in range(config.num_layers)]
    return sum(-(-length // block_size) if w is None else -(-(w - 1) // block_size) + 1 for w in windows)


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM
    from gpu_worker.engine.checkpoint import open_checkpoint

    window = open_checkpoint(args.model).config.sliding_window
    if window is None:
        raise SystemExit(f"{args.model} has no sliding window")
    result = {"date": date.today().isoformat(), "block_size": args.block_size, "dtype": args.dtype, "window": window,
              "models": {}}
    for name in (args.model, args.hybrid_model, args.full_model):
        config = open_checkpoint(name).config
        llm = LLM(model=name, dtype=args.dtype, block_size=args.block_size, enable_prefix_caching=False,
                  kv_cache_memory_bytes=256 << 20, max_model_len=max(MULTIPLES) * window)
        peaks = peak_layer_blocks(llm, window)
        bound = hybrid_bound(config, max(MULTIPLES) * window, args.block_size)
        result["models"][name] = {"layers": config.num_layers,
                                  "sliding_layers": sum(config.window_of(i) is not None
                                                        for i in range(config.num_layers)),
                                  "peak_layer_blocks": peaks, "ratio_8x_over_1x": peaks[8] / peaks[1],
                                  "bound_8x": bound, "ratio_8x_over_bound": peaks[8] / bound}
        del llm
    return result


def format_table(r: dict) -> str:
    lines = [f"tokenfleet bench kv-window — window {r['window']} tokens, blocks of {r['block_size']}, {r['date']}",
             "", "| model | sliding layers | " + " | ".join(f"layer-blocks at {m}x" for m in MULTIPLES)
             + " | 8x / 1x | bound at 8x | 8x / bound |", "|---|---:|" + "---:|" * (len(MULTIPLES) + 3)]
    for name, m in r["models"].items():
        lines.append(f"| {name} | {m['sliding_layers']} of {m['layers']} | "
                     + " | ".join(str(m["peak_layer_blocks"][k]) for k in MULTIPLES)
                     + f" | {m['ratio_8x_over_1x']:.2f} | {m['bound_8x']} | {m['ratio_8x_over_bound']:.2f} |")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))
