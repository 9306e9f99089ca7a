"""The Triton fused mixture of experts (gpu_worker/engine/kernels/triton_moe.py) against its torch reference, and
the reference against the CPU path (`moe.mixture` over `MLP` experts): on CUDA when there is one, else in Triton's
interpreter on CPU (fp32 and fp16; it is wrong in bf16)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="Triton is not installed")

from gpu_worker.engine.kernels.triton_moe import (  # noqa: E402
    align_by_expert,
    block_m_for,
    fused_moe,
    serves,
)
from gpu_worker.engine.mlp import MLP  # noqa: E402
from gpu_worker.engine.moe import fused_moe_reference, mixture  # noqa: E402
from gpu_worker.engine.ops import TorchOps  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if DEVICE.type == "cuda" else [])]
ACTIVATIONS = ["silu", "gelu_pytorch_tanh"]
E, H, I = 8, 64, 32  # noqa: E741 (the intermediate size's usual name)
UNCHOSEN = 6  # no token's router picks this expert


def _mixture_inputs(tokens: int, k: int, seed: int, h: int = H, i: int = I) -> tuple[torch.Tensor, ...]:
    """x [T, h], the stacked weights, and each token's k distinct experts (never UNCHOSEN) with positive weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=gen)
    w_gate_up = torch.randn(E, 2 * i, h, generator=gen) / h ** 0.5
    w_down = torch.randn(E, h, i, generator=gen) / i ** 0.5
    others = torch.tensor([e for e in range(E) if e != UNCHOSEN])
    experts = others[torch.rand(tokens, E - 1, generator=gen).argsort(dim=1)[:, :k]]
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
    return x, w_gate_up, w_down, weights, experts


def _fused(dtype: torch.dtype, activation: str, *inputs: torch.Tensor) -> torch.Tensor:
    x, w_gate_up, w_down, weights, experts = (t.to(DEVICE) for t in inputs)
    return fused_moe(x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights.to(dtype), experts, activation)


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # 16-bit: the kernel rounds the weighted product once and sums the k of them in fp32, where the reference
    # rounds each step; a few ulps (2^-8 of a value in bf16).
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=tol, atol=tol)


def test_aligning_pads_each_experts_pairs_to_whole_blocks_and_gives_an_unchosen_expert_none():
    experts = torch.tensor([[2, 0], [0, 2], [3, 0]])  # pairs 0..5 row-major; expert 1 chosen by none
    sorted_ids, block_experts, num_padded = align_by_expert(experts, num_experts=4, block_m=4)
    pad = experts.numel()
    used = sorted_ids[: num_padded.item()].tolist()
    assert used == [1, 2, 5, pad, 0, 3, pad, pad, 4, pad, pad, pad]
    assert block_experts[: num_padded.item() // 4].tolist() == [0, 2, 3]
    assert (sorted_ids[num_padded.item():] == pad).all() and sorted_ids.numel() % 4 == 0


@pytest.mark.parametrize(("tokens", "k"), [(1, 2), (5, 4), (33, 1), (200, 2)])
def test_aligning_places_every_pair_once_in_a_block_of_its_expert(tokens, k):
    experts = torch.rand(tokens, E).argsort(dim=1)[:, :k]
    block_m = block_m_for(tokens * k, E)
    sorted_ids, block_experts, num_padded = align_by_expert(experts, E, block_m)
    used = sorted_ids[: num_padded.item()].long()
    real = used < tokens * k
    assert sorted(used[real].tolist()) == list(range(tokens * k))
    block_of_slot = block_experts.long().repeat_interleave(block_m)[: num_padded.item()]
    assert torch.equal(block_of_slot[real], experts.flatten()[used[real]])


def test_a_decode_step_pads_to_the_smallest_block_and_a_long_prefill_to_the_widest():
    assert block_m_for(1 * 8, 128) == 16
    assert block_m_for(40 * 2, 8) == 16
    assert block_m_for(100 * 2, 8) == 32
    assert block_m_for(4096 * 8, 128) == 64


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_fused_moe_matches_the_reference_in_fp32(tokens, k, activation):
    inputs = _mixture_inputs(tokens, k, seed=tokens * 10 + k)
    _assert_close(_fused(torch.float32, activation, *inputs), fused_moe_reference(*inputs, activation),
                  torch.float32)


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_moe_matches_the_reference_in_16_bits(activation, dtype):
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in _mixture_inputs(17, 2, seed=7)]
    _assert_close(_fused(dtype, activation, *inputs), fused_moe_reference(*inputs, activation), dtype)


def test_fused_moe_takes_sizes_that_are_no_multiple_of_its_tiles():
    inputs = _mixture_inputs(9, 2, seed=3, h=40, i=24)  # K of 40 and 24 against tiles of 32, N of 48 and 40 of 64
    _assert_close(_fused(torch.float32, "silu", *inputs), fused_moe_reference(*inputs), torch.float32)


@pytest.mark.parametrize("k", [1, 2])
def test_fused_moe_serves_every_token_on_one_expert(k):
    x, w_gate_up, w_down, weights, _ = _mixture_inputs(33, k, seed=5)
    experts = torch.tensor([3, 5][:k]).expand(33, k).contiguous()  # expert 3 gets all 33 rows: three blocks
    want = fused_moe_reference(x, w_gate_up, w_down, weights, experts)
    _assert_close(_fused(torch.float32, "silu", x, w_gate_up, w_down, weights, experts), want, torch.float32)


def test_fused_moe_weights_each_pair_by_its_router_weight():
    x, w_gate_up, w_down, _, experts = _mixture_inputs(5, 2, seed=9)
    weights = torch.tensor([[1.0, 0.0]]).expand(5, 2)  # only each token's first expert counts
    alone = fused_moe_reference(x, w_gate_up, w_down, torch.ones(5, 1), experts[:, :1])
    _assert_close(_fused(torch.float32, "silu", x, w_gate_up, w_down, weights, experts), alone, torch.float32)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_the_reference_is_the_cpu_mixture_over_mlp_experts_with_the_same_weights(activation):
    x, w_gate_up, w_down, weights, experts = _mixture_inputs(7, 2, seed=11)
    mlps = [MLP(H, I, TorchOps(), act=activation) for _ in range(E)]
    with torch.no_grad():
        for mlp, gate_up, down in zip(mlps, w_gate_up, w_down, strict=True):
            mlp.gate_up_proj.weight.copy_(gate_up)
            mlp.down_proj.weight.copy_(down)
        want = mixture(lambda _: (weights, experts), mlps, x)
    torch.testing.assert_close(fused_moe_reference(x, w_gate_up, w_down, weights, experts, activation), want,
                               rtol=1e-6, atol=1e-6)


def test_the_fused_moe_serves_dense_float_weights_on_cuda_only():
    cpu = torch.zeros(2, 4, 8)
    assert not serves(cpu, cpu)
    assert not serves()
    if DEVICE.type == "cuda":
        dense = torch.zeros(2, 4, 8, device="cuda", dtype=torch.bfloat16)
        assert serves(dense, dense)
        assert not serves(dense, None)  # a quantized expert's linear holds no dense weight
        assert not serves(dense, dense.half())
        assert not serves(dense.to(torch.int8), dense.to(torch.int8))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the fused kernel serves a model's mixture on CUDA only")
def test_a_mixture_on_cuda_with_triton_ops_runs_fused_and_equals_the_grouped_mixture():
    from gpu_worker.engine.model_config import MoEConfig
    from gpu_worker.engine.moe import SparseMoE
    from gpu_worker.engine.ops import TritonOps

    moe = MoEConfig(num_experts=E, experts_per_token=2, expert_intermediate_size=I, renormalize=True)
    torch.manual_seed(0)
    grouped = SparseMoE(H, moe, TorchOps()).to(DEVICE)
    fused = SparseMoE(H, moe, TritonOps()).to(DEVICE)
    fused.load_state_dict(grouped.state_dict())
    x = torch.randn(9, H, device=DEVICE)
    with torch.no_grad():
        run = fused.bound()
        assert run.func.__name__ == "_fused_mixture"
        _assert_close(run(x), grouped.bound()(x), torch.float32)
