"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Mixtral, OLMoE, gpt-oss): a router scores every
expert for each token; each token runs through its top k experts, whose outputs are summed weighted by the router's
probabilities (`route`; gpt-oss's: `route_top_k_softmax`).

Tokens are grouped by expert rather than looped over: the (token, expert) pairs are sorted by expert, each expert
that any token chose runs one matmul over all its rows, and its outputs are added back to their tokens weighted
(vLLM's `fused_moe` and llama.cpp's `mul_mat_id` do the same). A batch-1 decode step so reads only the k chosen
experts' weights. Each expert is an `MLP` of `Linear`s, so every linear kernel (packed bf16, int8, int4) serves
experts as it serves dense layers. The router stays a dense `nn.Linear`: quantizing it would move tokens between
experts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import MLP, ClampedSwiGLUMLP
from .model_config import MoEConfig
from .ops import GATED_ACTIVATIONS, TorchOps


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, ops: TorchOps):
        super().__init__()
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=moe.router_bias)  # the router; HF's name
        self.experts = nn.ModuleList(_expert(hidden_size, moe, ops) for _ in range(moe.num_experts))
        self.top_k, self.renormalize, self.softmax_over_top_k = (moe.experts_per_token, moe.renormalize,
                                                                 moe.softmax_over_top_k)
        # gpt-oss's biased, clamped experts are not the fused kernel's SwiGLU: they are grouped (`mixture`)
        self.ops = ops if moe.clamped_swiglu is None else TorchOps()
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mixture(self.route, list(self.experts), x)

    def bound(self) -> Callable:
        """The fused kernel for the steps whose row count its ops take (`fused_moe_takes`), each expert's own
        kernels over its grouped rows for the others (`mixture`)."""
        grouped = functools.partial(mixture, self._router(), [expert.bound() for expert in self.experts])
        stacked = self._stacked_weights()
        if stacked is None:
            return grouped
        takes = functools.partial(self.ops.fused_moe_takes, num_experts=len(self.experts), top_k=self.top_k)
        fused = functools.partial(_fused_mixture, self.ops.fused_moe, self._router(), *stacked)
        return functools.partial(_fused_or_grouped, takes, fused, grouped)

    def _stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts' gate_up [E, 2I, H] and down [E, H, I] weights stacked for the fused kernel, each expert's
        linears then reading views of them (the weights are held once; stacked on the first call); None where the
        kernel does not take them."""
        gate_ups, downs = [e.gate_up_proj.weight for e in self.experts], [e.down_proj.weight for e in self.experts]
        if not self.ops.fused_moe_serves(*gate_ups, *downs):
            return None
        if self._stacked is None or any(w.data_ptr() != s.data_ptr() for w, s in zip(gate_ups, self._stacked[0],
                                                                                      strict=True)):
            self._stacked = torch.stack([w.detach() for w in gate_ups]), torch.stack([w.detach() for w in downs])
            for e, expert in enumerate(self.experts):
                expert.gate_up_proj.weight.data = self._stacked[0][e]
                expert.down_proj.weight.data = self._stacked[1][e]
        return self._stacked

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._router()(x)

    def _router(self) -> Callable:
        """The router with its weights bound, in float32 (`route`)."""
        gate = self.gate.weight.detach().float()
        if self.softmax_over_top_k:
            bias = None if self.gate.bias is None else self.gate.bias.detach().float()
            return functools.partial(route_top_k_softmax, gate, bias, self.top_k)
        return functools.partial(route, gate, self.top_k, self.renormalize)


def _expert(hidden_size: int, moe: MoEConfig, ops: TorchOps) -> MLP:
    if moe.clamped_swiglu is None:
        return MLP(hidden_size, moe.expert_intermediate_size, ops)
    return ClampedSwiGLUMLP(hidden_size, moe.expert_intermediate_size, ops, *moe.clamped_swiglu)


def route(gate: torch.Tensor, top_k: int, renormalize: bool, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k experts [T, k] and their weights [T, k] in x's dtype: the router's logits and softmax in
    float32 (transformers computes the logits in the model's dtype: equal in float32; in bf16 the choice is as
    close to the model's as it can be, and a bf16 matmul this small costs more on a CPU than a float32 one), then
    the k best, renormalised to sum to 1 where the model says."""
    probs = torch.softmax(F.linear(x.float(), gate), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def route_top_k_softmax(gate: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                        x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router, in transformers' order: the k largest of the (biased) logits, then a softmax over those k
    alone (in float32, as `route`)."""
    logits, experts = torch.topk(F.linear(x.float(), gate, bias), top_k, dim=-1)
    return torch.softmax(logits, dim=-1).to(x.dtype), experts


def _fused_or_grouped(takes: Callable[[int], bool], fused: Callable, grouped: Callable,
                      x: torch.Tensor) -> torch.Tensor:
    return fused(x) if takes(x.shape[0]) else grouped(x)


def _fused_mixture(fused: Callable, route: Callable, gate_up: torch.Tensor, down: torch.Tensor,
                   x: torch.Tensor) -> torch.Tensor:
    weights, experts = route(x)
    return fused(x, gate_up, down, weights, experts)


def mixture(route: Callable, experts: Sequence[Callable], x: torch.Tensor) -> torch.Tensor:
    """Sum over each row's chosen experts of weight × expert(row), one call per expert chosen by any row. A row's
    experts add in ascending order, as transformers adds them."""
    weights, chosen = route(x)
    if x.shape[0] == 1:  # a batch-1 decode step: its k experts over the one row, without grouping or scatter
        out = torch.zeros_like(x)
        for expert, weight in sorted(zip(chosen[0].tolist(), weights[0].tolist(), strict=True)):
            out += experts[expert](x) * weight
        return out
    k = chosen.shape[1]
    pairs = chosen.flatten()  # (row, its j-th expert), row-major
    by_expert = torch.argsort(pairs, stable=True)  # the pairs grouped by expert, rows ascending within each
    counts = torch.bincount(pairs, minlength=len(experts)).tolist()
    row_of, weight_of = by_expert // k, weights.flatten()[by_expert, None]
    out, start = torch.zeros_like(x), 0
    for expert, count in zip(experts, counts, strict=True):  # ascending: each row's experts add in that order
        if count:
            rows = row_of[start:start + count]
            out.index_add_(0, rows, expert(x.index_select(0, rows)) * weight_of[start:start + count])
            start += count
    return out


def fused_moe_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                        experts: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """`kernels/triton_moe.fused_moe` in torch, over the experts' stacked weights (w_gate_up [E, 2I, H], w_down
    [E, H, I]): each expert over the tokens that chose it, as an `MLP` computes it, weighted and added to its tokens
    in ascending expert order (as `mixture` adds them)."""
    act = getattr(TorchOps(), GATED_ACTIVATIONS[activation])
    out = torch.zeros_like(x)
    for expert in range(w_gate_up.shape[0]):
        tokens, slot = (experts == expert).nonzero(as_tuple=True)
        if tokens.numel():
            y = F.linear(act(F.linear(x[tokens], w_gate_up[expert])), w_down[expert])
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
    return out
