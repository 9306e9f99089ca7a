"""`tokenfleet bench quant`: each weight-quantization mode against bf16 on one model, in one run.

Quality (`bench quality`'s measures, bf16 as the reference): weight bytes, perplexity on held-out text, greedy
agreement with bf16 over 256 tokens, task accuracy. Speed: batch-1 decode and a mixed workload for every mode,
interleaved in rounds (each round runs every mode once, back to back), reported as the median ratio to bf16
with its spread; with `--peer llamacpp`, llama.cpp's q8_0 and q4_0 of the same checkpoint take part in each
round too. Modes: int8 / w8a8 / int4 quantized at load time (round to nearest, groups of 128 or the largest that
divides a layer's inputs), int4-awq (-g32) written by `tokenfleet quantize` (activation-aware scales, groups
of 128 or 32) and served with no flag, int4-awq-g32-table4 the same with an int4 embedding table (a tied one
stays int8 otherwise); gguf: a GGUF model's own file, its Q8_0 / Q4_0 / Q4_1 matrices served as
int8 / int4 (the other modes then start from a dense bf16 copy of the file's weights); kv-int8: bf16 weights with
an int8 KV cache (its token capacity against bf16's in the same pool is reported with the quality figures).
"""

from __future__ import annotations

import argparse
import gc
import statistics
from argparse import Namespace
from datetime import date
from pathlib import Path

import torch

from . import external_peers
from .contestants import ours_batch1_tps, ours_mixed
from .engine import weight_bytes
from .quality import Configuration, EngineSide, Settings, measure, prepare_inputs
from .quality_tasks import agreement, load_tasks, perplexity
from .report import add_output_argument, output_path, publish
from .workloads import batch1, mixed

MODES = ("bf16", "int8", "w8a8", "int4", "int4-awq", "int4-awq-g32", "int4-awq-g32-table4", "gguf", "kv-int8")
PEER_TYPES = {"int8": "q8_0", "int4": "q4_0", "gguf": "q4_1"}  # llama.cpp's nearest formats
DECODE_ROWS_WINDOWS = 4  # of the held-out windows, for the decode-rows perplexity (a forward per 4 tokens)
FORMAT_VERSION = 2  # of `tokenfleet quantize`'s files: int4 offsets since version 2 (zeros before)


def mode_configuration(mode: str, model: str) -> Configuration:
    if mode == "gguf":
        return Configuration(model, "bfloat16")  # the file's own quantized matrices, served as stored
    dense = dense_checkpoint(model)
    if mode == "kv-int8":
        return Configuration(dense, "bfloat16", kv_cache_dtype="int8")  # bf16 weights, int8 keys and values
    if mode.startswith("int4-awq"):
        table = "int4" if mode.endswith("-table4") else None
        return Configuration(str(converted(dense, "int4", 32 if "-g32" in mode else 128, table)), "bfloat16")
    return Configuration(dense, "bfloat16", quantization=None if mode == "bf16" else mode)


def dense_checkpoint(model: str) -> str:
    """The model with dense weights: a GGUF file serves its quantized matrices as they are, so its bf16
    reference (and the start of every other mode) is a dense bf16 copy of its dequantized weights."""
    from services.text.model_paths import checkpoint_path

    return str(converted(model, "bf16", 0)) if checkpoint_path(model).suffix == ".gguf" else model


def converted(model: str, method: str, group_size: int, table: str | None = None) -> Path:
    """`tokenfleet quantize`'s output for the model, made once and kept in the cache folder."""
    from gpu_worker.quantize.convert import quantize_checkpoint
    from services.text.builtin_models import cache_dir

    table_tag = f"-table-{table}" if table else ""
    out = cache_dir() / "quantized" / f"{Path(model).stem}-{method}-g{group_size}{table_tag}-v{FORMAT_VERSION}"
    if not (out / "model.safetensors").is_file():
        quantize_checkpoint(model, method, out, group_size, table=table)
    return out


def quality(model: str, modes: list[str], settings: Settings) -> dict:
    """Every mode against bf16, one model in memory at a time."""
    tasks = load_tasks(settings.tasks_path)
    results, reference_tokens, inputs = {}, None, None
    for mode in ["bf16", *[m for m in modes if m != "bf16"]]:
        side = EngineSide(mode_configuration(mode, model))
        inputs = inputs or prepare_inputs(side.llm, settings, tasks)
        measured = measure(side, inputs, settings, tasks)
        tokens = measured.pop("greedy_tokens")
        reference_tokens = reference_tokens or tokens
        measured["agreement"] = agreement(tokens, reference_tokens)
        measured["teacher_forced_pct"] = teacher_forced_agreement(side, inputs.prompts, reference_tokens)
        measured["weight_bytes"] = weight_bytes(side.llm.engine.runner.model)
        measured["kv_tokens"] = side.llm.engine.kv.pool.num_blocks * side.llm.engine.config.block_size
        del side
        gc.collect()
        measured["decode_rows"] = decode_rows_quality(mode_configuration(mode, model), inputs, reference_tokens)
        results[mode] = measured
    return results


def decode_rows_quality(config: Configuration, inputs, reference_tokens: list[list[int]]) -> dict:
    """Perplexity and teacher-forced agreement with every forward at most GEMV_ROWS tokens: through the kernels
    that serve decode steps (with VNNI their activations are int8 per run of 32), where prefill's chunks take
    the many-row kernels (bf16 activations)."""
    from gpu_worker.engine.quantization.kernels import GEMV_ROWS

    side = EngineSide(config, max_num_batched_tokens=GEMV_ROWS)
    windows = inputs.windows[:DECODE_ROWS_WINDOWS]
    result = {"windows": len(windows), "perplexity": perplexity(side.prompt_logprobs(windows)),
              "teacher_forced_pct": teacher_forced_agreement(side, inputs.prompts, reference_tokens)}
    del side
    gc.collect()
    return result


def teacher_forced_agreement(side: EngineSide, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """% of bf16's greedy tokens that are also this mode's top token when fed bf16's own prefix: agreement
    per position, without the compounding of free-running generation (one early difference there makes every
    later position differ)."""
    same = total = 0
    for prompt, tokens, top in zip(prompts, reference, side.teacher_forced_argmax(
            [p + t for p, t in zip(prompts, reference, strict=True)]), strict=True):
        predicted = top[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
        same += sum(a == b for a, b in zip(predicted, tokens, strict=True))
        total += len(tokens)
    return 100 * same / total


def speed(model: str, modes: list[str], args: Namespace) -> dict:
    """Tokens/s per mode and round; every mode loaded at once so that each round runs them back to back."""
    from gpu_worker.engine import LLM

    llms = {m: LLM(c.model, **c.engine_options())
            for m in modes for c in [mode_configuration(m, model)]}
    vocab = next(iter(llms.values())).engine.model_config.vocab_size
    b1, mix = batch1(vocab), mixed(vocab, args.num_requests)
    for llm in llms.values():
        ours_batch1_tps(llm, batch1(vocab, 16, 4, seed=1))  # warm-up
    rounds = []
    for _ in range(args.repeats):
        row = {f"{m} batch1": ours_batch1_tps(llm, b1) for m, llm in llms.items()}
        if not args.skip_mixed:
            row.update({f"{m} mixed": ours_mixed(llm, mix)["tps"] for m, llm in llms.items()})
        for peer_type in (PEER_TYPES[m] for m in modes if m in PEER_TYPES and "llamacpp" in args.peer):
            row[f"llama.cpp {peer_type} batch1"] = _llamacpp_batch1(model, peer_type, b1)
        rounds.append(row)
    return {"rounds": rounds, "ratios": _ratios(rounds)}


def _llamacpp_batch1(model: str, peer_type: str, b1) -> float | None:
    from gpu_worker.engine.checkpoint import resolve_model_path

    try:
        with external_peers.start("llamacpp", resolve_model_path(model), peer_type, b1, None) as peer:
            return peer.measure("batch1")[0]
    except external_peers.PeerError as exc:
        print(f"llama.cpp {peer_type}: {exc}")
        return None


def _ratios(rounds: list[dict]) -> dict:
    """Each figure over its workload's bf16 figure, per round: (median, min, max)."""
    out = {}
    for key in rounds[0]:
        base = f"bf16 {key.rsplit(' ', 1)[1]}"
        values = [r[key] / r[base] for r in rounds if r.get(key) and r.get(base)]
        if values and key != base:
            out[key] = (statistics.median(values), min(values), max(values))
    return out


def run(args: Namespace) -> dict:
    modes = ["bf16", *[m for m in args.modes.split(",") if m != "bf16"]]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes: {', '.join(sorted(unknown))} (choose from {', '.join(MODES)})")
    settings = Settings(windows=args.windows, prompts=args.num_prompts, new_tokens=args.new_tokens)
    result = {"date": date.today().isoformat(), "model": args.model, "threads": torch.get_num_threads(),
              "modes": modes, "settings": {**vars(settings), "tasks_path": str(settings.tasks_path)}}
    if not args.skip_quality:
        result["quality"] = quality(args.model, modes, settings)
    if not args.skip_speed:
        result["speed"] = speed(args.model, modes, args)
    return result


def format_table(r: dict) -> str:
    lines = [f"tokenfleet bench quant — {r['model']}, {r['date']}, {r['threads']} threads", ""]
    if "quality" in r:
        q, s = r["quality"], r["settings"]
        base = q["bf16"]
        lines += [f"quality: perplexity on {s['windows']} windows x {s['window_len']} tokens, greedy agreement "
                  f"with bf16 on {s['prompts']} prompts x {s['new_tokens']} tokens; decode rows: every forward at "
                  "most 4 tokens (the decode-step kernels), on "
                  f"{base['decode_rows']['windows']} windows",
                  "", "| mode | weight bytes | × bf16 | perplexity | Δ ppl | teacher-forced agreement | free-running "
                  "agreement | first divergence (median) | tasks | decode rows: Δ ppl | teacher-forced | KV tokens "
                  "× bf16 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for mode, m in q.items():
            ppl, ref = m["perplexity"]["perplexity"], base["perplexity"]["perplexity"]
            a, rows = m["agreement"], m["decode_rows"]
            rows_ppl = rows["perplexity"]["perplexity"] / base["decode_rows"]["perplexity"]["perplexity"] - 1
            size = m["weight_bytes"]
            lines.append(f"| {mode} | {size / 1e6:.1f} MB | {size / base['weight_bytes']:.3f} | {ppl:.3f} "
                         f"| {(ppl / ref - 1):+.2%} | {m['teacher_forced_pct']:.1f}% | {a['mean_equal_pct']:.1f}% | "
                         f"{a['median_first_divergence']:g} | {m['tasks']['accuracy']:.1%} | {rows_ppl:+.2%} "
                         f"| {rows['teacher_forced_pct']:.1f}% | {m['kv_tokens'] / base['kv_tokens']:.2f} |")
        lines.append("")
    if "speed" in r:
        sp = r["speed"]
        lines += [f"speed: {len(sp['rounds'])} interleaved rounds (median tok/s; ratio to bf16 per round: median "
                  "[min, max])", "", "| mode, workload | tok/s | × bf16 |", "|---|---:|---:|"]
        for key in sp["rounds"][0]:
            values = [row[key] for row in sp["rounds"] if row.get(key)]
            ratio = sp["ratios"].get(key)
            shown = "—" if ratio is None else f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]"
            lines.append(f"| {key} | {statistics.median(values) if values else float('nan'):.1f} | {shown} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="built-in or packaged name, HF directory or .gguf file (a trained model: random weights "
                        "make quality figures meaningless)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--peer", action="append", default=[], choices=["llamacpp"],
                   help="llama.cpp q8_0 / q4_0 of the same checkpoint in each speed round")
    p.add_argument("--repeats", type=int, default=3, help="speed rounds")
    p.add_argument("--num-requests", type=int, default=32, help="requests in the mixed workload")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-mixed", action="store_true")
    add_output_argument(p, "quant")


def run_from_args(args: Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))
