"""Turns logits into tokens: penalties, temperature, top-k / top-p / min-p, then one draw per row.

Each random draw is inverse-CDF sampling with a uniform derived from (request seed, output position)
alone, so a seeded request yields the same tokens whatever shares its batch, and a request resumed after
preemption or on another worker continues exactly where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .host_memory import to_device
from .ops import TorchOps
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
    def __init__(self, ops: TorchOps):
        self.ops = ops  # the model's: a greedy batch's argmax over its logits

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampledToken]:
        params = batch.params
        num_logprobs = [p.logprobs for p in params]
        if all(p.greedy and not p.has_penalties and n is None for p, n in zip(params, num_logprobs, strict=True)):
            return [SampledToken(t, None) for t in self.ops.argmax(logits).tolist()]
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in num_logprobs) else None
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, batch)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if not rand:
            tokens = logits.argmax(dim=-1)
        elif not greedy:
            tokens = _sample_random(logits, params, batch.uniforms)
        else:
            tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
            greedy_rows, rand_rows = to_device(greedy, torch.long, logits.device), to_device(rand, torch.long,
                                                                                              logits.device)
            tokens[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
            tokens[rand_rows] = _sample_random(logits[rand_rows], [params[i] for i in rand],
                                               [batch.uniforms[i] for i in rand])
        return _read_back(tokens, raw_logprobs, num_logprobs)


def _read_back(tokens: torch.Tensor, raw: torch.Tensor | None, num_logprobs: list[int | None]) -> list[SampledToken]:
    """The sampled ids, with the log-probabilities asked for (the sampled token's and the top-N, raw model ones),
    read from the device in one copy: the step's one wait for it."""
    if raw is None:
        return [SampledToken(t, None) for t in tokens.tolist()]
    top = max(n for n in num_logprobs if n is not None)
    columns = [tokens.double()[:, None], raw.gather(1, tokens[:, None]).double()]
    if top:
        values, ids = raw.topk(top, dim=-1)
        columns += [ids.double(), values.double()]
    out = []
    for row, n in zip(torch.cat(columns, dim=1).tolist(), num_logprobs, strict=True):
        token = int(row[0])
        if n is None:
            out.append(SampledToken(token, None))
            continue
        result = {token: row[1]}
        for i, v in zip(row[2:2 + n], row[2 + top:2 + top + n], strict=True):
            result.setdefault(int(i), v)
        out.append(SampledToken(token, result))
    return out


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM/OpenAI semantics: repetition over prompt and output, presence and frequency over output."""
    rows, vocab = logits.shape
    device = logits.device
    counts = _token_counts(batch.output_token_ids, vocab, device)
    rep, freq, pres = to_device([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                                 for p in batch.params], torch.float32, device).T[:, :, None]
    seen = (counts + _token_counts(batch.prompt_token_ids, vocab, device)) > 0
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = to_device([t + [vocab] * (width - len(t)) for t in token_lists], torch.long, device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _sample_random(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> torch.Tensor:
    """Rows that filter draw along their own sorted order, the others along vocabulary order: a row's
    token depends on its own logits, parameters and uniform only, never on its neighbours in the batch."""
    device = logits.device
    temps = to_device([p.temperature for p in params], torch.float32, device)[:, None]
    probs = torch.softmax(logits / temps, dim=-1)
    u = to_device(uniforms, torch.float64, device)
    filtering = [p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
    if not any(filtering):
        return _inverse_cdf(probs, u)
    if all(filtering):
        return _sample_filtered(probs, params, u)
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    plain = to_device([i for i, f in enumerate(filtering) if not f], torch.long, device)
    filtered = [i for i, f in enumerate(filtering) if f]
    filtered_rows = to_device(filtered, torch.long, device)
    tokens[plain] = _inverse_cdf(probs[plain], u[plain])
    tokens[filtered_rows] = _sample_filtered(probs[filtered_rows], [params[i] for i in filtered], u[filtered_rows])
    return tokens


def _sample_filtered(probs: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    kept = _filter_sorted(sorted_probs, params)
    return order.gather(1, _inverse_cdf(kept, u)[:, None])[:, 0]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]), right=True)
    return picks.clamp_(max=probs.shape[-1] - 1)[:, 0]


def _filter_sorted(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device, vocab = probs.device, probs.shape[-1]
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.long, device)[:, None]
    top_p, min_p = to_device([[p.top_p, p.min_p] for p in params], torch.float32, device).T[:, :, None]
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (ranks >= top_k) | ((mass_before >= top_p) & (top_p < 1.0)) | (probs < min_p * probs[:, :1])
    drop[:, 0] = False
    return probs.masked_fill(drop, 0.0)
