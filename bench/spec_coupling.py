"""What sampling a self-draft's guesses with the request's own uniforms costs in acceptance.

The verifier keeps a guess where the target's sample at that position equals it; the draft samples with the same
per-position uniform (inverse CDF along the vocabulary), so it guesses the target's token exactly where the two
inverse CDFs agree, and seeded output stays the non-speculative output. The standard rejection sampler would keep
sum_x min(p(x), q(x)) of a draft's guesses instead (the most any verifier can), with output that changes with
speculation. Both are computed exactly, position by position, from the two models' logits over texts the target
wrote itself, at a few temperatures without top-k/top-p (the coupling's worst case: a filtered request draws along
its sorted probabilities, where close distributions agree more).
"""

from __future__ import annotations

import torch

TEMPERATURES = (0.7, 1.0)


def coupling(llm, draft_runner, texts: list[list[int]], prompt_lens: list[int]) -> dict[str, dict[str, float]]:
    """Per temperature: mean acceptance of a draft sampled with the target's uniforms ("coupled") and of the
    rejection sampler ("optimal") over the texts' output positions; greedy agreement as "greedy"."""
    sums = {t: {"coupled": 0.0, "optimal": 0.0} for t in TEMPERATURES}
    agree, positions = 0, 0
    for tokens, prompt_len in zip(texts, prompt_lens, strict=True):
        target = _logits(llm.engine, llm.engine.runner, tokens)[prompt_len - 1:-1]
        draft = _logits(llm.engine, draft_runner, tokens)[prompt_len - 1:-1]
        agree += (target.argmax(-1) == draft.argmax(-1)).sum().item()
        positions += len(target)
        for t in TEMPERATURES:
            p, q = torch.softmax(target / t, -1), torch.softmax(draft / t, -1)
            sums[t]["optimal"] += torch.minimum(p, q).sum().item()
            sums[t]["coupled"] += _inverse_cdf_overlap(p, q).sum().item()
    result = {f"T={t}": {k: v / positions for k, v in s.items()} for t, s in sums.items()}
    return result | {"greedy": {"agreement": agree / positions}}


def _inverse_cdf_overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per row: the probability that one uniform picks the same token from p and from q by inverse CDF."""
    p_hi, q_hi = p.double().cumsum(-1), q.double().cumsum(-1)
    overlap = torch.minimum(p_hi, q_hi) - torch.maximum(p_hi - p.double(), q_hi - q.double())
    return overlap.clamp(min=0.0).sum(-1)


@torch.inference_mode()
def _logits(engine, runner, tokens: list[int]) -> torch.Tensor:
    """The model's float32 logits after every prefix of `tokens`, in one prefill through the engine's KV cache."""
    from gpu_worker.engine.sampling_params import SamplingParams
    from gpu_worker.engine.scheduler import ScheduledChunk
    from gpu_worker.engine.sequence import Sequence

    seq = Sequence(-1, "spec-coupling", 0, list(tokens), len(tokens), SamplingParams(), seed=0)
    if not engine.kv.allocate_slots(seq, len(tokens)):
        raise RuntimeError("the KV cache cannot hold the measuring text")
    try:
        chunk = ScheduledChunk(seq, 0, len(tokens), engine.kv.block_table(seq), sample=False)
        ids, positions, meta = runner.prepare([chunk])
        return runner.model.logits(runner.model(ids, positions, runner.kv_caches, meta)).float()
    finally:
        engine.kv.free(seq)
