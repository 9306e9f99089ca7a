"""One generated sample: its tokens, progress through the model, and finish state (plain data)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request with n samples is n sequences sharing a group id and the prompt.

    `num_computed_tokens` counts tokens whose KV is in the cache; preemption by recompute resets it
    to zero and keeps `token_ids`, so the sequence resumes where it stopped.
    """

    seq_id: int
    group_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    priority: int = 0
    arrival: int = 0
    num_computed_tokens: int = 0
    # Tokens whose KV a draft model with a cache of its own holds (speculative decoding): at most those the target
    # holds, since a rejected guess's draft KV is stale; zero after preemption, as the blocks are gone.
    num_draft_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    enqueued_step: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    cache_salt: str | None = None  # prefix-cache keys start from it: hits only within the same salt
    guess_acceptance: float = 1.0  # recent share of speculative guesses kept (a moving average)
    num_guessed_tokens: int = 0  # speculative guesses scored for this sequence, and those it kept
    num_kept_guesses: int = 0
    # Samples 1..n-1 of a group wait here until sample 0 has prefilled the prompt, then share its blocks.
    forks_pending: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def check_token_stop(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        """Finish on stop token, eos, max_tokens or the context limit, after a token was appended."""
        last = self.token_ids[-1]
        if last in self.params.stop_token_ids:
            self.finish("stop", last)
        elif not self.params.ignore_eos and last in eos_token_ids:
            self.finish("stop", None)
        elif self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            self.finish("length")


@dataclass(frozen=True)
class ResumedChoice:
    """A sample partly produced elsewhere (by a worker that died): it continues from `token_ids` as a
    recompute preemption does, and its text is handed out from character `text_emitted` on."""

    index: int
    token_ids: list[int]
    text_emitted: int
