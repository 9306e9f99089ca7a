"""gpt-oss's mixture tensors as the loader takes every mixture's: one tensor per expert and projection, under
Qwen3-MoE's names and in its layout, which `loader._FUSED` then fuses as it fuses theirs.

transformers' gpt-oss checkpoints stack each layer's experts: `mlp.experts.gate_up_proj` [E, H, 2I] (input-major,
gate and up in alternating columns), `gate_up_proj_bias` [E, 2I] (alternating too), `down_proj` [E, I, H] and
`down_proj_bias` [E, H]; the router is `mlp.router` (weight and bias). Each expert becomes `mlp.experts.{e}.gate_proj`,
`up_proj` and `down_proj` (weight [out, in], and bias), the router `mlp.gate`.

The released checkpoints store the two expert matrices as MXFP4 (`quantization_config` {"quant_method": "mxfp4"}):
`{proj}_blocks` [E, out, in / 32, 16] uint8, 32 FP4 (e2m1) values per group, two per byte, the low nibble first, and
`{proj}_scales` [E, out, in / 32] uint8, each group's E8M0 exponent (the group is scaled by 2^(scale - 127)).
transformers' `integrations/mxfp4.py` reads them so on a CPU. Each expert's become an `Mxfp4Weight` (views of the
stack): served as stored where a kernel takes them (CUDA with Triton), dequantized by the loader one expert at a time
elsewhere (a layer's whole stack in float32 would take gigabytes).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.text.errors import ModelLoadError

from .quantization.weights import Mxfp4Weight, QuantizedWeight

_STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_MXFP4 = ("_blocks", "_scales")

Tensors = Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]


def unstack_experts(architecture: str, tensors: Tensors) -> Tensors:
    """The checkpoint's tensors with gpt-oss's stacked experts and router renamed and split per expert (MXFP4 ones
    once both their blocks and scales have arrived: a sharded checkpoint may hold them apart); every
    other tensor as it comes. Other architectures' tensors pass unchanged: transformers stacks their experts
    otherwise in memory ([E, 2I, H], gate then up) but saves them one by one, so a stacked one has no place."""
    if architecture != "GptOssForCausalLM":
        yield from tensors
        return
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3:-1] == ["mlp", "router"]:
            yield ".".join([*parts[:-2], "gate", parts[-1]]), tensor
            continue
        if len(parts) < 3 or parts[-3:-1] != ["mlp", "experts"]:
            yield name, tensor
            continue
        prefix, leaf = ".".join(parts[:-1]), parts[-1]
        if leaf in _STACKED:
            yield from _per_expert(prefix, leaf, tensor, transposed=True)
        elif leaf.endswith(_MXFP4) and leaf[:-7] in _STACKED:
            pair = halves.setdefault(f"{prefix}.{leaf[:-7]}", {})
            pair[leaf[-6:]] = tensor
            if len(pair) == 2:
                del halves[f"{prefix}.{leaf[:-7]}"]
                yield from _per_expert(prefix, leaf[:-7], pair, transposed=False)
        else:
            yield name, tensor
    if halves:
        raise ModelLoadError(f"MXFP4 tensors without their blocks or scales: {', '.join(sorted(halves))}")


def _per_expert(prefix: str, leaf: str, stacked: torch.Tensor | dict[str, torch.Tensor],
                transposed: bool) -> Tensors:
    """One expert's rows at a time: a dense stack is [E, in, out] (`transposed`), an MXFP4 one [E, out, in]."""
    count = (stacked["blocks"] if isinstance(stacked, dict) else stacked).shape[0]
    proj, is_bias = leaf.removesuffix("_bias"), leaf.endswith("_bias")
    for e in range(count):
        if isinstance(stacked, dict):
            blocks, scales = stacked["blocks"][e], stacked["scales"][e]
            if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
                raise ModelLoadError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
            rows = Mxfp4Weight(blocks.flatten(-2), scales)
        else:
            rows = stacked[e] if is_bias else stacked[e].T
        suffix = "bias" if is_bias else "weight"
        if proj == "down_proj":
            yield f"{prefix}.{e}.down_proj.{suffix}", rows
        else:  # gate and up alternate
            gate, up = (rows[i::2] if isinstance(rows, torch.Tensor)
                        else rows.select_rows(torch.arange(i, rows.shape[0], 2)) for i in (0, 1))
            yield f"{prefix}.{e}.gate_proj.{suffix}", gate
            yield f"{prefix}.{e}.up_proj.{suffix}", up
