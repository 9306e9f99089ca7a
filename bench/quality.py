"""`tokenfleet bench quality`: what a configuration of our engine serves, against a reference.

The reference is another engine configuration (e.g. float32 against our bfloat16) or HF transformers on the same
checkpoint. Three figures, the yardstick of quantization, speculative decoding and routing work:
perplexity on held-out text, greedy agreement with the reference token by token, and accuracy on a task set with
checked answers. Both sides get the same token ids (tokenized once, by the configuration's tokenizer), so the
reference must share that tokenizer.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

import torch

from . import hf_peer
from .quality_tasks import (
    HELDOUT_SOURCE,
    OPEN_PROMPTS,
    TASKS_PATH,
    agreement,
    heldout_text,
    load_tasks,
    perplexity,
    task_scores,
    windows,
)
from .report import add_output_argument, output_path, publish

DTYPES = ["auto", "float32", "bfloat16", "float16"]
HF_BATCH = 16  # prompts per HF `generate` call: left padding costs little while prompts are of similar lengths


@dataclass(frozen=True)
class Configuration:
    """What is served; options that change what a model computes (quantization, speculation) belong here."""

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    engine: str = "tokenfleet"  # or "hf": transformers on the same checkpoint
    quantization: str | None = None  # weights quantized at load time (int8, int4)
    kv_cache_dtype: str = "auto"  # or int8

    @property
    def label(self) -> str:
        quantized = f" {self.quantization}" if self.quantization else ""
        kv = f" kv {self.kv_cache_dtype}" if self.kv_cache_dtype != "auto" else ""
        return f"{self.engine} {self.model} {self.dtype}{quantized}{kv} {self.device}"

    def engine_options(self) -> dict:
        return dict(dtype=self.dtype, device=self.device, quantization=self.quantization,
                    kv_cache_dtype=self.kv_cache_dtype)


@dataclass(frozen=True)
class Settings:
    """How much of each measurement to run: by default both sides take 1.5 (ours vs ours) to 2.5 minutes (ours vs
    HF) on 2 idle cores with SmolLM2-135M."""

    windows: int = 16
    window_len: int = 512
    prompts: int = 16
    new_tokens: int = 256
    task_tokens: int = 48
    tasks_path: Path = TASKS_PATH


@dataclass
class Inputs:
    windows: list[list[int]]
    prompts: list[list[int]]  # chat-templated
    task_prompts: list[list[int]]
    stop_ids: frozenset[int]
    decode: Callable[[list[int]], str] = field(repr=False)  # the configuration's tokenizer


class EngineSide:
    def __init__(self, config: Configuration, **engine_options):
        from gpu_worker.engine import LLM

        self.llm = LLM(config.model, **config.engine_options(), **engine_options)

    def prompt_logprobs(self, windows: list[list[int]]) -> list[list[float]]:
        from gpu_worker.engine import SamplingParams

        outs = self.llm.generate(windows, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
        return [out.prompt_logprobs[1:] for out in outs]

    def greedy(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[list[int]]:
        from gpu_worker.engine import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        return [out.token_ids for out in self.llm.generate(prompts, params)]

    def teacher_forced_argmax(self, sequences: list[list[int]]) -> list[list[int]]:
        """The model's top token after every position of each sequence, one sequence at a time (the model's
        hidden states are read as the engine computes them, over as many prefill chunks as it takes)."""
        from gpu_worker.engine import SamplingParams

        model = self.llm.engine.runner.model
        chunks: list[list[int]] = []
        hook = model.register_forward_hook(
            lambda _m, _args, hidden: chunks.append(model.logits(hidden).argmax(dim=-1).tolist()))
        found = []
        try:
            with self.llm.engine.runner.through_modules():
                for seq in sequences:
                    self.llm.generate([seq], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
                    found.append([t for chunk in chunks for t in chunk])
                    chunks.clear()
        finally:
            hook.remove()
        return found


class HFSide:
    def __init__(self, config: Configuration, stop_ids: frozenset[int]):
        from transformers import GenerationConfig

        from gpu_worker.engine.checkpoint import open_checkpoint

        path = open_checkpoint(config.model).path  # what our engine would load: an HF directory or a .gguf file
        dtype = config.dtype if config.dtype == "auto" else getattr(torch, config.dtype)
        self.model = hf_peer.load(path, dtype).to(config.device)
        # Plain greedy decoding: a checkpoint's generation_config.json (repetition penalty...) is not what we serve.
        self.model.generation_config = GenerationConfig()
        self.device, self.stop_ids = torch.device(config.device), stop_ids

    def prompt_logprobs(self, windows: list[list[int]]) -> list[list[float]]:
        out = []
        with torch.inference_mode():
            for window in windows:
                ids = torch.tensor([window], device=self.device)
                logprobs = torch.log_softmax(self.model(ids).logits[0, :-1].float(), dim=-1)
                out.append(logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist())
        return out

    def greedy(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[list[int]]:
        return [tokens for i in range(0, len(prompts), HF_BATCH)
                for tokens in self._generate(prompts[i:i + HF_BATCH], max_tokens, ignore_eos)]

    def _generate(self, batch: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[list[int]]:
        ids, mask = hf_peer.left_padded(batch)
        width = ids.shape[1]
        # No eos at all with ignore_eos: like our engine, an eos token is then just another token.
        eos = None if ignore_eos else sorted(self.stop_ids)
        with torch.inference_mode():
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                                      max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=0)
        rows = [row[width:].tolist() for row in out]
        return rows if ignore_eos else [_through_first_stop(row, self.stop_ids) for row in rows]


def _through_first_stop(tokens: list[int], stop_ids: frozenset[int]) -> list[int]:
    """A sequence HF stopped early is padded to the batch's longest: keep it up to its stop token, as we do."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    return tokens[:end]


def prepare_inputs(llm, settings: Settings, tasks) -> Inputs:
    tokenizer = llm.tokenizer

    def chat(prompt: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])

    if settings.prompts > len(OPEN_PROMPTS):
        raise ValueError(f"at most {len(OPEN_PROMPTS)} prompts, not {settings.prompts}")
    text_ids = tokenizer.hf.encode(heldout_text(), add_special_tokens=False)
    return Inputs(windows(text_ids, settings.window_len, settings.windows),
                  [chat(p) for p in OPEN_PROMPTS[:settings.prompts]], [chat(t.prompt) for t in tasks],
                  llm.engine.eos_token_ids, tokenizer.decode)


def measure(side, inputs: Inputs, settings: Settings, tasks) -> dict:
    started = time.perf_counter()
    result = {"perplexity": perplexity(side.prompt_logprobs(inputs.windows)),
              "greedy_tokens": side.greedy(inputs.prompts, settings.new_tokens, ignore_eos=True)}
    answers = side.greedy(inputs.task_prompts, settings.task_tokens, ignore_eos=False)
    result["tasks"] = task_scores(tasks, [inputs.decode(a) for a in answers])
    result["seconds"] = time.perf_counter() - started
    return result


def run(config: Configuration, reference: Configuration, settings: Settings) -> dict:
    """The configuration first (its tokenizer prepares both sides' inputs), then the reference, one at a time."""
    if config.engine != "tokenfleet":
        raise ValueError("the configuration is what our engine serves: engine must be 'tokenfleet'")
    tasks = load_tasks(settings.tasks_path)
    side = EngineSide(config)
    inputs = prepare_inputs(side.llm, settings, tasks)
    ours = measure(side, inputs, settings, tasks)
    del side
    gc.collect()  # one model in memory at a time
    side = HFSide(reference, inputs.stop_ids) if reference.engine == "hf" else EngineSide(reference)
    theirs = measure(side, inputs, settings, tasks)
    return {"date": date.today().isoformat(), "threads": torch.get_num_threads(),
            "configuration": asdict(config), "reference": asdict(reference),
            "settings": {**asdict(settings), "tasks_path": str(settings.tasks_path)},
            "heldout": {"source": HELDOUT_SOURCE, "windows": len(inputs.windows)},
            "agreement": agreement(ours.pop("greedy_tokens"), theirs.pop("greedy_tokens")),
            "results": {"configuration": ours, "reference": theirs}}


def format_table(r: dict) -> str:
    s, ours, theirs = r["settings"], r["results"]["configuration"], r["results"]["reference"]
    labels = [Configuration(**r[side]).label for side in ("configuration", "reference")]
    a = r["agreement"]
    differ = [x["id"] for x, y in zip(ours["tasks"]["results"], theirs["tasks"]["results"], strict=True)
              if x["right"] != y["right"]]
    lines = [f"tokenfleet bench quality — {r['date']}, {r['threads']} threads: perplexity on {s['windows']} windows "
             f"x {s['window_len']} tokens of held-out text, {len(ours['tasks']['results'])} tasks "
             f"({s['task_tokens']} tokens), greedy agreement on {s['prompts']} prompts x {s['new_tokens']} tokens",
             "", "| | configuration | reference |", "|---|---|---|",
             f"| served | {labels[0]} | {labels[1]} |",
             f"| perplexity | {ours['perplexity']['perplexity']:.3f} | {theirs['perplexity']['perplexity']:.3f} |",
             f"| task accuracy | {ours['tasks']['accuracy']:.1%} | {theirs['tasks']['accuracy']:.1%} |",
             f"| seconds | {ours['seconds']:.0f} | {theirs['seconds']:.0f} |", "",
             f"greedy agreement: {a['mean_equal_pct']:.1f}% of positions equal, median first divergence "
             f"{a['median_first_divergence']:g}, {a['identical']}/{len(a['prompts'])} prompts identical",
             "first divergence per prompt: " + " ".join(
                 "none" if p["first_divergence"] is None else str(p["first_divergence"]) for p in a["prompts"]),
             f"tasks scored differently: {', '.join(differ) or 'none'}"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = Settings()
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="built-in or packaged name, HF directory or .gguf file")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quantization", default=None, help="int8 / int4: weights quantized at load time")
    p.add_argument("--reference", default="tokenfleet", choices=["tokenfleet", "hf"],
                   help="the reference's engine: ours, or HF transformers on the same checkpoint")
    p.add_argument("--reference-model", default=None, help="default: --model (it must share its tokenizer)")
    p.add_argument("--reference-dtype", default="float32", choices=DTYPES)
    p.add_argument("--reference-device", default=None, help="default: --device")
    p.add_argument("--windows", type=int, default=defaults.windows, help="held-out windows for perplexity")
    p.add_argument("--window-len", type=int, default=defaults.window_len)
    p.add_argument("--num-prompts", type=int, default=defaults.prompts, help="prompts for greedy agreement")
    p.add_argument("--new-tokens", type=int, default=defaults.new_tokens, help="greedy tokens per prompt")
    p.add_argument("--task-tokens", type=int, default=defaults.task_tokens, help="answer tokens per task")
    p.add_argument("--tasks", type=Path, default=defaults.tasks_path, help="task set (JSONL)")
    add_output_argument(p, "quality")


def run_from_args(args: argparse.Namespace) -> int:
    config = Configuration(args.model, args.dtype, args.device, quantization=args.quantization)
    reference = Configuration(args.reference_model or args.model, args.reference_dtype,
                              args.reference_device or args.device, engine=args.reference)
    settings = Settings(windows=args.windows, window_len=args.window_len, prompts=args.num_prompts,
                        new_tokens=args.new_tokens, task_tokens=args.task_tokens, tasks_path=args.tasks)
    result = run(config, reference, settings)
    return publish(result, format_table(result), output_path(args))
