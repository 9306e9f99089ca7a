"""Activation-aware scaling for int4 weights (AWQ, Lin et al. 2023), searched on calibration activations.

A few input channels carry most of the activation magnitude; their weights matter most. Scaling weight column
j by s_j (and the input by 1/s_j) gives those columns more of the int4 grid. For each linear group the search
tries s = mean|x|^alpha for alpha in [0, 1] and keeps the alpha whose quantized output is closest to the
dense output on the calibration rows. The 1/s is folded into the op before the linear (the RMSNorm weight,
or the rows of the projection that feeds it), so the served model runs no extra op and computes the same
function before quantization.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.engine.model import Transformer
from services.text.errors import ModelLoadError

ALPHAS = torch.linspace(0, 1, 21).tolist()


@dataclass
class ScaleGroup:
    """Linear(s) reading one input, and how to divide that input by s at its source."""

    name: str
    weight: torch.Tensor  # [N, K], scaled in place
    fold: Callable[[torch.Tensor], None]  # divides the source of the input by s, in place


def scale_groups(model: Transformer) -> list[ScaleGroup]:
    groups = []
    cfg = model.config
    if cfg.moe is not None:
        raise ModelLoadError(f"AWQ calibration of a mixture of experts ({cfg.architecture}) is not implemented: "
                             "quantize it with --method int8 or int4")
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        groups.append(ScaleGroup(f"layers.{i}.self_attn.qkv_proj", attn.qkv_proj.weight.data,
                                 lambda s, n=layer.input_layernorm: n.weight.data.div_(s)))
        if cfg.num_heads == cfg.num_kv_heads:  # v's output channel j is o's input channel j only without GQA
            v_rows = attn.qkv_proj.weight.data[attn.q_size + attn.kv_size:]
            groups.append(ScaleGroup(f"layers.{i}.self_attn.o_proj", attn.o_proj.weight.data,
                                     lambda s, v=v_rows, a=attn: _div_rows(v, a.qkv_proj.bias, s,
                                                                           a.q_size + a.kv_size)))
        groups.append(ScaleGroup(f"layers.{i}.mlp.gate_up_proj", mlp.gate_up_proj.weight.data,
                                 lambda s, n=layer.post_attention_layernorm: n.weight.data.div_(s)))
        up_rows = mlp.gate_up_proj.weight.data[cfg.intermediate_size:]
        groups.append(ScaleGroup(f"layers.{i}.mlp.down_proj", mlp.down_proj.weight.data,
                                 lambda s, up=up_rows: up.div_(s[:, None])))
    return groups


def _div_rows(rows: torch.Tensor, bias: torch.Tensor | None, s: torch.Tensor, offset: int) -> None:
    rows.div_(s[:, None])
    if bias is not None:
        bias.data[offset:offset + s.numel()].div_(s)


def best_scale(weight: torch.Tensor, x: torch.Tensor, fake_quantize: Callable[[torch.Tensor], torch.Tensor]
               ) -> tuple[torch.Tensor, float]:
    """(s, alpha): the per-input-channel scale that minimizes the quantized output's squared error on x."""
    x, w = x.float(), weight.float()
    dense = x @ w.T
    magnitude = x.abs().mean(dim=0).clamp(min=1e-6)
    best = (float("inf"), torch.ones_like(magnitude), 0.0)
    for alpha in ALPHAS:
        s = magnitude.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        error = (x @ (fake_quantize(w * s) / s).T - dense).pow(2).mean().item()
        if error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]


def apply_awq(model: Transformer, inputs: dict[str, torch.Tensor],
              fake_quantize: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """Scales every group's weight in place and folds 1/s into its input's source; returns alpha by group."""
    alphas = {}
    for group in scale_groups(model):
        s, alphas[group.name] = best_scale(group.weight, inputs[group.name], fake_quantize)
        group.weight.mul_(s)
        group.fold(s)
    return alphas
