"""Mixtures of experts: tokens grouped by expert, each chosen expert run once over its rows; quantization leaves the
router dense. (Exactness against HF: test_matches_hf.py's qwen3-moe and mixtral.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu_worker.engine import LLM
from gpu_worker.engine.model_config import MoEConfig
from gpu_worker.engine.moe import SparseMoE, mixture
from gpu_worker.engine.ops import TorchOps


class _Scaling:
    """An expert that multiplies its rows by a factor, and records the rows it was called with."""

    def __init__(self, factor: float):
        self.factor, self.calls = factor, []

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls.append(rows.clone())
        return rows * self.factor


def test_each_chosen_expert_runs_once_over_all_its_rows_and_unchosen_ones_not_at_all():
    x = torch.arange(1.0, 5.0).unsqueeze(1)  # four rows: 1, 2, 3, 4
    chosen = torch.tensor([[2, 0], [0, 2], [2, 0], [0, 3]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    experts = [_Scaling(f) for f in (10.0, 100.0, 1000.0, 10000.0)]
    out = mixture(lambda _: (weights, chosen), experts, x)
    assert [len(e.calls) for e in experts] == [1, 0, 1, 1]
    assert experts[0].calls[0].flatten().tolist() == [1, 2, 3, 4]
    assert experts[2].calls[0].flatten().tolist() == [1, 2, 3]
    expected = [1 * (0.75 * 1000 + 0.25 * 10), 2 * (0.5 * 10 + 0.5 * 1000), 3 * 1000, 4 * (0.25 * 10 + 0.75 * 10000)]
    assert out.flatten().tolist() == pytest.approx(expected)


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_router_weighs_each_rows_top_k_by_softmax_renormalised_only_where_the_model_says(renormalize):
    moe = SparseMoE(4, MoEConfig(num_experts=3, experts_per_token=2, expert_intermediate_size=8,
                                 renormalize=renormalize), TorchOps())
    with torch.no_grad():
        moe.gate.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]]))
    weights, chosen = moe.route(torch.tensor([[3.0, 2.0, 0.0, 0.0]]))
    probs = torch.softmax(torch.tensor([3.0, 2.0, 0.0]), dim=0)
    top = probs[:2] / probs[:2].sum() if renormalize else probs[:2]
    assert chosen.tolist() == [[0, 1]]
    torch.testing.assert_close(weights[0], top)


def test_int8_quantizes_every_experts_linears_and_leaves_the_router_dense(make_checkpoint):
    model = LLM(str(make_checkpoint("qwen3-moe")), dtype="bfloat16", quantization="int8").engine.runner.model
    moe, dense = model.layers[0].mlp, model.layers[1].mlp  # the checkpoint's second layer is dense
    int8_kernel = type(dense.gate_up_proj.kernel)
    assert dense.gate_up_proj.weight is None and "Int8" in int8_kernel.__name__
    assert all(linear.weight is None and type(linear.kernel) is int8_kernel
               for expert in moe.experts for linear in (expert.gate_up_proj, expert.down_proj))
    assert isinstance(moe.gate, nn.Linear) and moe.gate.weight.dtype == torch.bfloat16
