"""The native CPU mixture of experts (AVX512-BF16): decode-sized steps' whole mixture in one call, each expert's own
kernels past them; against the torch reference (`moe.fused_moe_reference`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.engine import EngineConfig
from gpu_worker.engine.kernel_choice import choose_kernels
from gpu_worker.engine.kernels import cpu_has_avx512_bf16, cpu_kernels
from gpu_worker.engine.model_config import MoEConfig
from gpu_worker.engine.moe import SparseMoE, fused_moe_reference, mixture
from gpu_worker.engine.ops import NativeCpuOps, TorchOps

pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the native kernels need AVX512-BF16")

E, H, I = 8, 64, 96  # noqa: E741 (the intermediate size's usual name)


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())


@pytest.mark.parametrize("counts", [[1, 0, 3, 0, 0, 2, 7, 1], [0] * 7 + [12], [5] * 8])
def test_the_grouped_product_multiplies_each_experts_rows_by_that_experts_weight(counts):
    gen = torch.Generator().manual_seed(sum(counts))
    w = torch.randn(E, 48, H, generator=gen).bfloat16()
    offsets = F.pad(torch.tensor(counts).cumsum(0), (1, 0))
    x = torch.randn(sum(counts), H, generator=gen).bfloat16()
    got = cpu_kernels().grouped_mm_bf16(x, w, offsets)
    want = torch.cat([x[offsets[e]:offsets[e + 1]].float() @ w[e].float().T for e in range(E)])
    _bf16_close(got, want)


def test_a_rows_grouped_product_does_not_depend_on_the_other_rows_of_its_expert():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(E, 48, H, generator=gen).bfloat16()
    x = torch.randn(7, H, generator=gen).bfloat16()
    every = cpu_kernels().grouped_mm_bf16(x, w, torch.tensor([0, 7, 7, 7, 7, 7, 7, 7, 7]))
    alone = cpu_kernels().grouped_mm_bf16(x[3:4].contiguous(), w, torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 1]))
    assert torch.equal(every[3], alone[0])


def _mixture_inputs(tokens: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    w_gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).bfloat16()
    w_down = (torch.randn(E, H, I, generator=gen) / I ** 0.5).bfloat16()
    weights, experts = torch.softmax(torch.randn(tokens, E, generator=gen), -1).topk(k, dim=-1)
    return x, w_gate_up, w_down, weights.bfloat16(), experts


@pytest.mark.parametrize(("tokens", "k"), [(1, 2), (2, 2), (16, 4), (9, 3)])
def test_the_native_mixture_equals_the_reference(tokens, k):
    inputs = _mixture_inputs(tokens, k)
    got = NativeCpuOps(cpu_kernels()).fused_moe(*inputs)
    want = fused_moe_reference(*(t.float() if t.is_floating_point() else t for t in inputs))
    _bf16_close(got, want)


def test_the_native_mixture_rounds_as_its_ops_composed_one_by_one():
    """The grouped products, silu, the weighting and each addition rounded to bf16 where torch's ops would."""
    x, w_gate_up, w_down, weights, experts = _mixture_inputs(12, 3, seed=4)
    kernels = cpu_kernels()
    chosen, ascending = experts.sort(dim=1)
    order = torch.argsort(chosen.flatten(), stable=True)
    offsets = F.pad(torch.bincount(chosen.flatten(), minlength=E).cumsum(0), (1, 0))
    hidden = kernels.silu_and_mul_bf16(kernels.grouped_mm_bf16(x[order // 3], w_gate_up, offsets))
    per_pair = torch.empty(36, H, dtype=torch.bfloat16)
    per_pair[order] = kernels.grouped_mm_bf16(hidden, w_down, offsets)
    per_pair = (per_pair * weights.gather(1, ascending).flatten()[:, None]).view(12, 3, H)
    want = per_pair[:, 0] + per_pair[:, 1]
    want += per_pair[:, 2]
    assert torch.equal(kernels.moe_silu_bf16(x, w_gate_up, w_down, weights, experts), want)


def test_the_native_ops_fuse_decode_sized_steps_of_dense_bf16_experts_only():
    ops = NativeCpuOps(cpu_kernels())
    dense = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16)
    assert ops.fused_moe_serves(dense, dense)
    assert not ops.fused_moe_serves(dense, None)  # a quantized expert's linear holds no dense weight
    assert not ops.fused_moe_serves(dense.float(), dense.float())
    assert [ops.fused_moe_takes(rows, num_experts=32, top_k=4) for rows in (1, 2, 64, 65)] == [True, True, True, False]
    # batch-invariant mode: every step's experts by the row-invariant product, whatever shares the step
    assert not choose_kernels(EngineConfig("", deterministic=True), torch.bfloat16).ops.fused_moe_serves(dense, dense)


def test_a_bf16_mixture_on_native_ops_runs_fused_for_decode_steps_and_equals_the_grouped_mixture():
    moe = SparseMoE(H, MoEConfig(num_experts=E, experts_per_token=2, expert_intermediate_size=I, renormalize=True),
                    NativeCpuOps(cpu_kernels()))
    torch.manual_seed(0)
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    moe = moe.bfloat16()
    x = torch.randn(6, H).bfloat16()
    reference = mixture(moe.route, [e.bound() for e in moe.experts], x)  # before stacking: each expert's kernels
    bound = moe.bound()
    assert moe._stacked is not None and moe.experts[3].gate_up_proj.weight.data_ptr() == moe._stacked[0][3].data_ptr()
    _bf16_close(bound(x), reference.float())
    _bf16_close(bound(x[:1]), reference[:1].float())
    assert TorchOps().fused_moe_serves(moe._stacked[0], moe._stacked[1]) is False
