"""The dense feed-forward block of a decoder layer, and of each expert in a mixture (`moe.py`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from .linear import Linear
from .ops import GATED_ACTIVATIONS, TorchOps


class MLP(nn.Module):
    """A gated MLP: gate and up projections in one matmul, act(gate) * up, then down. SwiGLU (silu), or GeGLU with
    tanh-approximated GELU (Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: TorchOps, act: str = "silu",
                 bias: bool = False):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = getattr(ops, GATED_ACTIVATIONS[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self.gate_up_proj, self.act, self.down_proj, x)

    def bound(self) -> Callable:
        return functools.partial(gated_mlp, self.gate_up_proj.bound(), self.act, self.down_proj.bound())


class ClampedSwiGLUMLP(MLP):
    """gpt-oss's expert: biased projections, and a SwiGLU whose gate is clamped above at `limit` and whose up to
    ±limit, (up + 1) * gate * sigmoid(alpha * gate) (`ops.clamped_swiglu_and_mul`). Its gate and up rows sit as
    every MLP's do (gate then up); the loader de-interleaves transformers' alternating columns."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: TorchOps, alpha: float, limit: float):
        super().__init__(hidden_size, intermediate_size, ops, bias=True)
        self.act = functools.partial(ops.clamped_swiglu_and_mul, alpha=alpha, limit=limit)


def gated_mlp(gate_up_proj: Callable, act: Callable, down_proj: Callable, x: torch.Tensor) -> torch.Tensor:
    return down_proj(act(gate_up_proj(x)))
