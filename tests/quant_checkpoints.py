"""Quantized checkpoints for tests, made from a dense HF checkpoint: GPTQ / AWQ directories as the common tools
write them (tensors by `quant_packers`), and the dense twin holding exactly the weights they dequantize to."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gpu_worker.engine.quantization.methods import WeightQuantizer
from tests import quant_packers

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_layer_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def _copy_dir(src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> Path:
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    return out


def four_bit_checkpoints(src: Path, out: Path, fmt: str, group_size: int, desc_act: bool = False,
                         v2: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """(quantized dir, dense dir with the weights the quantized one dequantizes to) for fmt gptq or awq."""
    generator = torch.Generator().manual_seed(seed)
    dense = load_file(src / "model.safetensors")
    packed, dequantized = {}, {}
    for name, w in dense.items():
        if not _is_layer_linear(name):
            packed[name] = dequantized[name] = w
            continue
        g_idx = quant_packers.act_order_g_idx(w.shape[1], group_size, generator) if desc_act else None
        q, scales, zeros = quant_packers.quantize_groupwise(w, group_size, g_idx)
        if fmt == "gptq" and not v2:
            zeros = zeros.clamp(min=1)  # the classic format cannot store a zero point of 0
        dequantized[name] = quant_packers.dequantize_groupwise(q, scales, zeros, group_size, g_idx).to(w.dtype)
        pack: Callable = quant_packers.pack_gptq if fmt == "gptq" else quant_packers.pack_awq
        extra = {"g_idx": g_idx, "v2": v2} if fmt == "gptq" else {}
        for suffix, tensor in pack(q, scales, zeros, group_size, **extra).items():
            packed[name.removesuffix("weight") + suffix] = tensor
    config = (quant_packers.gptq_quantization_config(group_size, desc_act, v2, sym=False) if fmt == "gptq"
              else quant_packers.awq_quantization_config(group_size))
    return (_copy_dir(src, out / f"{fmt}-quantized", packed, config),
            _copy_dir(src, out / f"{fmt}-dense", dequantized, None))


def with_dequantized_weights(src: Path, out: Path, quantizer: WeightQuantizer) -> Path:
    """A dense copy of `src` whose linear and embedding weights are `quantizer(w).dequantize()` (the table
    as `quantizer.for_table` quantizes it)."""
    tensors = load_file(src / "model.safetensors")
    table = quantizer.for_table(tied="lm_head.weight" not in tensors)
    for name, w in tensors.items():
        if _is_layer_linear(name) or name.startswith("lm_head"):
            tensors[name] = quantizer(w).dequantize().to(w.dtype)
        elif "embed_tokens" in name:
            tensors[name] = table(w).dequantize().to(w.dtype)
    return _copy_dir(src, out, tensors, None)
