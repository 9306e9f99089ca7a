"""Turns logits into tokens: penalties, temperature, top-k / top-p / min-p, then one draw per row.

Each random draw is inverse-CDF sampling with a uniform derived from (request seed, output position)
alone, so a seeded request yields the same tokens whatever shares its batch, and a request resumed after
preemption or on another worker continues exactly where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def position_uniform(seed: int, position: int) -> float:
    """SplitMix64 of (seed, position) mapped to [0, 1)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


@dataclass
class SamplingBatch:
    params: list[SamplingParams]
    uniforms: list[float]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None  # the sampled token and the top-N, as raw-model log-probabilities


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampledToken]:
        params = batch.params
        num_logprobs = [p.logprobs for p in params]
        if all(p.greedy and not p.has_penalties and n is None for p, n in zip(params, num_logprobs, strict=True)):
            return [SampledToken(t, None) for t in ops.argmax(logits).tolist()]
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in num_logprobs) else None
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, batch)
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        if rand:
            tokens[rand] = _sample_random(logits[rand], [params[i] for i in rand],
                                          [batch.uniforms[i] for i in rand])
        token_list = tokens.tolist()
        return [SampledToken(t, _logprobs_of(raw_logprobs, i, t, num_logprobs[i]))
                for i, t in enumerate(token_list)]


def _logprobs_of(raw: torch.Tensor | None, row: int, token: int, top_n: int | None) -> dict[int, float] | None:
    if top_n is None:
        return None
    result = {token: raw[row, token].item()}
    if top_n:
        values, ids = raw[row].topk(top_n)
        for i, v in zip(ids.tolist(), values.tolist(), strict=True):
            result.setdefault(i, v)
    return result


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM/OpenAI semantics: repetition over prompt and output, presence and frequency over output."""
    rows, vocab = logits.shape
    device = logits.device
    counts = _token_counts(batch.output_token_ids, vocab, device)
    rep = torch.tensor([p.repetition_penalty for p in batch.params], device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in batch.params], device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in batch.params], device=device)[:, None]
    seen = (counts + _token_counts(batch.prompt_token_ids, vocab, device)) > 0
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long, device=device)
        for i, t in enumerate(token_lists):
            padded[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _sample_random(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> torch.Tensor:
    """Rows that filter draw along their own sorted order, the others along vocabulary order: a row's
    token depends on its own logits, parameters and uniform only, never on its neighbours in the batch."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
    probs = torch.softmax(logits / temps, dim=-1)
    u = torch.tensor(uniforms, dtype=torch.float64, device=device)
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    filtering = [p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
    plain = [i for i, f in enumerate(filtering) if not f]
    filtered = [i for i, f in enumerate(filtering) if f]
    if plain:
        tokens[plain] = _inverse_cdf(probs[plain], u[plain])
    if filtered:
        sorted_probs, order = probs[filtered].sort(dim=-1, descending=True)
        kept = _filter_sorted(sorted_probs, [params[i] for i in filtered])
        tokens[filtered] = order.gather(1, _inverse_cdf(kept, u[filtered])[:, None])[:, 0]
    return tokens


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]), right=True)
    return picks.clamp_(max=probs.shape[-1] - 1)[:, 0]


def _filter_sorted(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device, vocab = probs.device, probs.shape[-1]
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (ranks >= top_k) | ((mass_before >= top_p) & (top_p < 1.0)) | (probs < min_p * probs[:, :1])
    drop[:, 0] = False
    return probs.masked_fill(drop, 0.0)
