"""Speculative decoding: a proposer guesses a running sequence's next tokens, the step scores them with its last
token in one forward, and the verifier keeps the guesses the model itself would have produced.

At batch 1 a decode step is bound by reading the weights, and scoring k + 1 positions costs about what scoring
one does: every accepted guess is a token for (nearly) free.

The verifier samples every scored position as a step without guesses would (the request's own penalties,
temperature, top-k/top-p/min-p, and the uniform of that output position), then keeps the guesses up to the first
that differs from the model's pick, and the pick there. The output is therefore the non-speculative output token
for token, greedy or seeded. For a proposer that guesses one token per position (q one-hot, as n-gram lookup and
a draft read greedily do) this is the standard rejection sampler exactly: a guess x is kept with probability
p(x) = min(1, p(x) / q(x)), and a rejected position's token is p's pick conditioned on differing from x, which is
p with x removed, renormalised: the residual (p - q)+ normalised. So reproducing the non-speculative output costs
no acceptance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from .scheduler_output import ScheduledChunk
from .sequence import Sequence

# ngram: prompt lookup; draft: a smaller model with the target's tokenizer (`draft_model`); self-int8 / self-int4:
# the target's own weights quantized at load time draft the guesses.
METHODS = ("ngram", "draft", "self-int8", "self-int4")
# Below this recent acceptance a sequence gets no guesses: scoring them costs more than the few kept save. Each
# step without guesses raises it by RECOVERY, so the sequence is tried again after a while (its text may turn to
# quoting). A step's kept share moves the average by KEPT_WEIGHT.
MIN_ACCEPTANCE = 0.3
RECOVERY = 0.02
KEPT_WEIGHT = 0.3


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys: `method`, `num_speculative_tokens`, `prompt_lookup_min/max`, `model` (the
    draft model: a model name, HF directory or GGUF file; `draft_model` works too), `disable_by_batch_size` (no
    guesses while more sequences than this run: a large batch's step is bound by compute, where every guess scored
    is a row of work, not a free one)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 4
    model: str | None = None

    @classmethod
    def parse(cls, value: dict | None) -> SpeculativeConfig | None:
        if value is None:
            return None
        if "draft_model" in value:
            value = {**{k: v for k, v in value.items() if k != "draft_model"}, "model": value["draft_model"]}
        known = {f.name for f in fields(cls)}
        if unknown := set(value) - known:
            raise ValueError(f"unknown speculative settings: {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(sorted(known))})")
        if not {"method", "num_speculative_tokens"} <= set(value):
            raise ValueError("speculative settings need 'method' and 'num_speculative_tokens'")
        config = cls(**value)
        if config.method not in METHODS:
            raise ValueError(f"speculative method {config.method!r} is not supported; supported: {', '.join(METHODS)}")
        if (config.method == "draft") != (config.model is not None):
            raise ValueError("a draft model ('model') is what method 'draft' needs, and only it")
        if config.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        return config

    @property
    def self_draft_quantization(self) -> str | None:
        """int8 or int4 for a quantized self-draft, else None."""
        return self.method.removeprefix("self-") if self.method.startswith("self-") else None


class Proposer:
    """Guesses the next tokens of decoding sequences. The scheduler asks `max_guesses` of each sequence it may
    let guess, holds that many KV slots, then asks `propose` once for all of the step's guessing chunks (so a
    draft model can step them as one batch); a proposer may return fewer guesses than the slots it was given.

    `max_guesses` adapts: fewer guesses where fewer are kept, none below MIN_ACCEPTANCE for a while."""

    def __init__(self, k: int, max_batch: int):
        self.k, self.max_batch = k, max_batch

    def max_guesses(self, seq: Sequence, room: int) -> int:
        if seq.guess_acceptance < MIN_ACCEPTANCE:
            seq.guess_acceptance += RECOVERY
            return 0
        return max(min(math.ceil(self.k * seq.guess_acceptance), room), 0)

    def propose(self, chunks: list[ScheduledChunk]) -> list[list[int]]:
        raise NotImplementedError


class NoProposer(Proposer):
    """Speculation off: no sequence gets guesses."""

    def __init__(self) -> None:
        super().__init__(0, 0)

    def propose(self, chunks: list[ScheduledChunk]) -> list[list[int]]:
        return [[] for _ in chunks]


class NgramProposer(Proposer):
    """Prompt lookup: the longest suffix of the sequence (prompt and output) that occurred earlier in it proposes
    the tokens that followed its latest earlier occurrence. Strong where the output quotes its input (RAG answers,
    code edits, summaries with citations); free where it finds nothing."""

    def __init__(self, config: SpeculativeConfig):
        super().__init__(config.num_speculative_tokens, config.disable_by_batch_size)
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, chunks: list[ScheduledChunk]) -> list[list[int]]:
        return [self.lookup(c.seq.token_ids, c.max_guesses) for c in chunks]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(starts):
                follow = starts[-1] + n
                return tokens[follow:follow + k].tolist()
        return []


def record_kept(seq: Sequence, guessed: int, kept: int) -> None:
    seq.guess_acceptance += KEPT_WEIGHT * (kept / guessed - seq.guess_acceptance)
    seq.num_guessed_tokens += guessed
    seq.num_kept_guesses += kept


@dataclass
class SpeculationStats:
    """vLLM's counters: drafts (steps where a sequence had guesses), draft tokens, accepted tokens, and how often
    the guess at each position was kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, guessed: int, kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += guessed
        self.num_accepted_tokens += kept
        self.accepted_per_position.extend([0] * (guessed - len(self.accepted_per_position)))
        for position in range(kept):
            self.accepted_per_position[position] += 1


def accepted_prefix(guesses: list[int], picks: list[int]) -> list[int]:
    """The tokens a step with guesses produces: the guesses the model agrees with, then its own next token.
    picks[i] is the model's sample (argmax when greedy) after the sequence and guesses[:i]."""
    out = []
    for guess, pick in zip(guesses, picks, strict=False):
        out.append(pick)
        if guess != pick:
            return out
    out.append(picks[len(guesses)])
    return out
