"""`tokenfleet quantize`: a dense checkpoint -> an HF-style directory of int8 / int4 weights that serves with
no flag (safetensors in `TokenfleetFormat`, `quantization_config` in config.json), as gpt-fast's two phases;
`--method bf16` writes a plain bf16 directory (a GGUF file's weights, dequantized, as a dense checkpoint).

int8: per output channel, symmetric. int4: groups of `group_size` inputs (or the largest supported group that
divides a weight's inputs), asymmetric, after activation-aware scaling (`awq.py`) on calibration text.
Every linear and the embedding table are quantized; norms and biases stay dense.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpu_worker.engine import LLM, SamplingParams
from gpu_worker.engine.checkpoint import Checkpoint, HFCheckpoint, open_checkpoint
from gpu_worker.engine.linear import Linear
from gpu_worker.engine.loader import qkv_row_order, shard_sizes
from gpu_worker.engine.model import Embedding, Transformer
from gpu_worker.engine.quantization.formats import TokenfleetFormat
from gpu_worker.engine.quantization.methods import DEFAULT_GROUP_SIZE, WeightQuantizer
from services.text.errors import ModelLoadError

from .awq import apply_awq, scale_groups
from .hf_config import fused_in_hf, hf_config

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
CALIBRATION_TOKENS = 512
_SPLITS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass
class Conversion:
    out: Path
    quantized_bytes: int
    bf16_bytes: int  # the same weights in bf16
    alphas: dict[str, float]
    seconds: float


def quantize_checkpoint(model: str, method: str, out: Path, group_size: int = DEFAULT_GROUP_SIZE,
                        calibration: Path | None = None, table: str | None = None) -> Conversion:
    """`table`: the embedding table's method (int8 or int4); by default int8 where the LM head shares it
    (see `WeightQuantizer.for_table`), else the weights' own."""
    started = time.perf_counter()
    checkpoint = open_checkpoint(model)
    config = _config(checkpoint)  # before loading: what a GGUF file's HF config cannot say is refused first
    if checkpoint.quantization is not None:
        raise ModelLoadError(f"{checkpoint.path} is already quantized ({checkpoint.quantization.name})")
    if method not in ("int8", "int4", "bf16"):
        raise ValueError(f"method must be int8, int4 or bf16; got {method!r}")
    if table not in (None, "int8", "int4") or (table is not None and method == "bf16"):
        raise ValueError(f"the table's method must be int8 or int4, with --method int8 or int4; got {table!r}")
    llm = LLM(model, dtype="float32", enable_prefix_caching=False)
    net = llm.engine.runner.model
    alphas = {}
    if method == "bf16":  # a plain dense copy, e.g. of a GGUF file's dequantized weights
        tensors, quantized_bytes, bf16_bytes = _quantized_tensors(net, None, torch.bfloat16)
        config = {**config, "torch_dtype": "bfloat16", **({"dtype": "bfloat16"} if "dtype" in config else {})}
    else:
        quantizer = WeightQuantizer(method, group_size, table)
        if method == "int4":
            text = (calibration or CALIBRATION_TEXT).read_text()
            alphas = apply_awq(net, _calibration_inputs(llm, text), quantizer.fake)
        tensors, quantized_bytes, bf16_bytes = _quantized_tensors(net, quantizer, checkpoint.config.checkpoint_dtype)
        fmt = TokenfleetFormat(quantizer.bits, group_size if method == "int4" else None)
        config = {**config, "quantization_config": fmt.quantization_config()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(checkpoint, llm, out)
    return Conversion(out, quantized_bytes, bf16_bytes, alphas, time.perf_counter() - started)


def _calibration_inputs(llm: LLM, text: str) -> dict[str, torch.Tensor]:
    """Each scale group's input rows over the calibration text's first CALIBRATION_TOKENS tokens."""
    ids = llm.tokenizer.encode(text)[:CALIBRATION_TOKENS]
    modules = dict(llm.engine.runner.model.named_modules())
    captured: dict[str, list[torch.Tensor]] = {}
    hooks = [modules[g.name].register_forward_pre_hook(
        lambda _m, args, name=g.name: captured.setdefault(name, []).append(args[0].detach().clone()))
        for g in scale_groups(llm.engine.runner.model)]
    try:
        # Prompt log-probabilities keep every row through the last layer, which otherwise runs the sampled row
        # alone: its groups calibrate on every token too.
        with llm.engine.runner.through_modules():
            llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.cat(rows) for name, rows in captured.items()}


def _quantized_tensors(net: Transformer, quantizer: WeightQuantizer | None,
                       dense_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], int, int]:
    """HF-named tensors, quantized (or, without a quantizer, dense in `dense_dtype`): fused linears split back
    into q/k/v and gate/up where the architecture's HF checkpoints split them (rows quantize independently);
    norms and biases in `dense_dtype`."""
    fmt_of = {8: TokenfleetFormat(8), 4: TokenfleetFormat(4)}
    tensors: dict[str, torch.Tensor] = {}
    quantized_bytes = bf16_bytes = 0
    tied = net.lm_head.weight is net.embed_tokens.weight
    modules = dict(net.named_modules())
    kept_fused = fused_in_hf(net.config.architecture)
    served_order = qkv_row_order(net.config)  # partial rotary: q/k rows as served, put back in the checkpoint's
    for name, param in net.named_parameters():  # a tied LM head is the embedding's parameter: listed once
        module = name.rpartition(".")[0]
        if served_order is not None and module.endswith("self_attn.qkv_proj"):
            param = param.detach()[torch.argsort(served_order)]
        if not name.endswith(".weight") or not isinstance(modules[module], Linear | Embedding):  # norms, a router
            tensors[_hf(name)] = param.detach().to(dense_dtype).contiguous()
            continue
        fused = next((f for f in _SPLITS if module.endswith(f) and f not in kept_fused), None)
        parts = ([param] if fused is None else
                 param.detach().split(shard_sizes(net.config, module)))
        names = [module] if fused is None else [module.replace(fused, part) for part in _SPLITS[fused]]
        for part_name, rows in zip(names, parts, strict=True):
            bf16_bytes += rows.numel() * 2
            if quantizer is None:
                tensors[f"{_hf(part_name)}.weight"] = rows.detach().to(dense_dtype).contiguous()
                quantized_bytes += rows.numel() * dense_dtype.itemsize
                continue
            weight = (quantizer.for_table(tied) if module == "embed_tokens" else quantizer)(rows.detach())
            quantized_bytes += weight.nbytes
            for suffix, tensor in fmt_of[weight.bits].write(weight).items():
                tensors[f"{_hf(part_name)}.{suffix}"] = tensor.contiguous()
    return tensors, quantized_bytes, bf16_bytes


def _hf(name: str) -> str:
    return name if name.startswith("lm_head") else f"model.{name}"


def _config(checkpoint: Checkpoint) -> dict:
    """The source's config.json, or a GGUF file's config as its architecture's HF config (`hf_config.py`); without
    quantization_config (a source's MXFP4 experts, gpt-oss's, are dequantized at load)."""
    if isinstance(checkpoint, HFCheckpoint):
        raw = json.loads((checkpoint.path / "config.json").read_text())
    else:
        raw = hf_config(checkpoint.config, str(checkpoint.path))
    raw.pop("quantization_config", None)
    return raw


def _copy_tokenizer(checkpoint: Checkpoint, llm: LLM, out: Path) -> None:
    if isinstance(checkpoint, HFCheckpoint):
        for file in checkpoint.path.iterdir():
            if file.is_file() and file.name != "config.json" and not file.name.startswith("model"):
                shutil.copy2(file, out / file.name)
    else:
        llm.tokenizer.hf.save_pretrained(out)


def main(args: argparse.Namespace) -> int:
    done = quantize_checkpoint(args.model, args.method, args.out, args.group_size, args.calibration, args.table)
    print(f"wrote {done.out} in {done.seconds:.1f} s: weights {done.quantized_bytes / 1e6:.1f} MB "
          f"({done.quantized_bytes / done.bf16_bytes:.3f}x of bf16)")
    return 0
