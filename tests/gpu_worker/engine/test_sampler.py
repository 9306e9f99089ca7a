"""Sampler on hand-made float32 logits: filters, penalties, seeded inverse-CDF draws, raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.engine.ops import TorchOps
from gpu_worker.engine.sampler import Sampler, SamplingBatch, apply_penalties, position_uniform
from gpu_worker.engine.sampling_params import SamplingParams

SEED = 1234


def sample(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float] | None = None,
           prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None):
    rows = len(params)
    batch = SamplingBatch(params, uniforms or [position_uniform(SEED, i) for i in range(rows)],
                          prompts or [[] for _ in range(rows)], outputs or [[] for _ in range(rows)])
    return Sampler(TorchOps())(logits, batch)


def tokens(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> list[int]:
    return [t.token_id for t in sample(logits, params, **kwargs)]


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * 3


def repeated(row: list[float], n: int) -> torch.Tensor:
    return torch.tensor([row], dtype=torch.float32).repeat(n, 1)


def test_greedy_picks_the_argmax():
    logits = random_logits(4, 100)
    assert tokens(logits, [SamplingParams(temperature=0.0)] * 4) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature):
    logits = random_logits(200, 50)
    picked = tokens(logits, [SamplingParams(temperature=temperature, top_k=1)] * 200)
    assert picked == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = repeated([1.0, 1.2, 0.9, 1.1], 300)  # nearly flat: without the filter all four would appear
    assert set(tokens(logits, [SamplingParams(top_p=1e-6)] * 300)) == {1}


def test_min_p_drops_tokens_below_that_fraction_of_the_top_probability():
    probs = [0.45, 0.05, 0.30, 0.08, 0.12]
    logits = repeated([math.log(p) for p in probs], 1000)
    uniforms = [(i + 0.5) / 1000 for i in range(1000)]  # an even sweep of [0, 1)
    picked = tokens(logits, [SamplingParams(min_p=0.25)] * 1000, uniforms=uniforms)
    counts = [picked.count(t) for t in range(5)]
    kept = 0.45 + 0.30 + 0.12  # tokens 1 and 3 are below 0.25 * 0.45
    assert counts[1] == counts[3] == 0
    for t in (0, 2, 4):
        assert abs(counts[t] - 1000 * probs[t] / kept) <= 2, "the kept tokens are renormalized"


def test_penalties_follow_the_vllm_and_openai_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams()]
    batch = SamplingBatch(params, [0.0, 0.0], prompt_token_ids=[[0, 4], [0]],
                          output_token_ids=[[1, 3, 3], [1]])
    penalized = apply_penalties(logits, batch)
    expected = [
        2.0 / 2,                   # in the prompt only: repetition divides a positive logit
        -1.0 * 2 - 0.5 * 1 - 0.25,  # output once: repetition multiplies a negative one, then freq + presence
        0.5,                       # never seen
        3.0 / 2 - 0.5 * 2 - 0.25,   # output twice: frequency counts occurrences, presence does not
        -2.0 * 2,                  # prompt only, negative
    ]
    assert penalized[0].tolist() == pytest.approx(expected)
    assert torch.equal(penalized[1], logits[1]), "a row without penalties is left alone"


@pytest.mark.parametrize("other", [
    dict(temperature=0.0), dict(temperature=0.7), dict(presence_penalty=1.0),
    dict(top_k=5), dict(top_p=0.5), dict(min_p=0.1),
], ids=["greedy", "temperature", "penalty", "top_k", "top_p", "min_p"])
def test_a_seeded_draw_does_not_depend_on_the_other_rows_in_the_batch(other):
    logits = random_logits(2, 64, seed=3)
    uniforms = [position_uniform(SEED, pos) for pos in range(50)]
    alone = [tokens(logits[:1], [SamplingParams()], uniforms=[u])[0] for u in uniforms]
    pair = [SamplingParams(), SamplingParams(**other)]
    batched = [tokens(logits, pair, uniforms=[u, 0.5], outputs=[[], [1, 2]])[0] for u in uniforms]
    mismatches = sum(a != b for a, b in zip(alone, batched, strict=True))
    assert mismatches == 0, (
        f"ENGINE BUG: the same (seed, position) uniform picked a different token in {mismatches}/50 draws "
        f"once a row with {other} joined the batch (sampler.py _sample_random inverts the CDF in "
        "probability-sorted order for every row as soon as any row filters, in vocabulary order otherwise)")


def top_k_softmax(z: torch.Tensor, k: int) -> torch.Tensor:
    return torch.softmax(z.masked_fill(z < z.topk(k).values[-1], -math.inf), dim=-1)


@pytest.mark.parametrize(("params", "probs_of"), [
    (SamplingParams(temperature=1.0), lambda z: torch.softmax(z, -1)),
    (SamplingParams(temperature=0.5), lambda z: torch.softmax(z / 0.5, -1)),
    (SamplingParams(top_k=3), lambda z: top_k_softmax(z, 3)),
], ids=["t1", "t0.5", "top_k3"])
def test_draws_over_many_positions_follow_the_softmax_distribution(params, probs_of):
    z = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    n = 20000
    picked = tokens(z.repeat(n, 1), [params] * n)  # row i uses position_uniform(SEED, i)
    observed = torch.bincount(torch.tensor(picked), minlength=len(z)).double()
    expected = probs_of(z).double() * n
    support = expected > 0
    assert observed[~support].sum() == 0, "filtered tokens must never be drawn"
    chi2 = ((observed[support] - expected[support]) ** 2 / expected[support]).sum().item()
    assert chi2 < 25.0, f"chi-square {chi2:.1f} with {int(support.sum()) - 1} degrees of freedom"


def test_logprobs_hold_the_sampled_token_and_top_n_from_the_raw_logits():
    logits = torch.tensor([[2.0, 1.8, 1.5, 0.0, -1.0]])
    raw = torch.log_softmax(logits, dim=-1)[0]
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2)
    (result,) = sample(logits, [params], prompts=[[0, 1]])  # the penalty halves tokens 0 and 1 below token 2
    assert result.token_id == 2
    assert result.logprobs.keys() == {0, 1, 2}
    for token, logprob in result.logprobs.items():
        assert logprob == pytest.approx(raw[token].item()), "logprobs come from the logits before penalties"


def test_logprobs_zero_returns_only_the_sampled_token_and_none_returns_none():
    logits = random_logits(2, 30)
    with_zero, without = sample(logits, [SamplingParams(logprobs=0), SamplingParams()])
    assert with_zero.logprobs.keys() == {with_zero.token_id}
    assert without.logprobs is None
