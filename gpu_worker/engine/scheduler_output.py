"""What the scheduler decides each step, as the model runner and the speculative proposers read it: which tokens of
which sequences run, and which sequences it preempted."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class ScheduledChunk:
    """Run tokens [start, start + num_tokens) of `seq` (its KV in `block_tables`, one per KV-cache group); sample a
    token after them when `sample` is set.

    A decode chunk may end in `guesses`, a proposer's tokens after the sequence's last (at most `max_guesses`, for
    which it holds KV slots): the step scores them too, and the sequence keeps those the model agrees with
    (speculative decoding)."""

    seq: Sequence
    start: int
    num_tokens: int
    block_tables: list[list[int]]
    sample: bool
    guesses: list[int] = field(default_factory=list)
    max_guesses: int = 0

    def add_guesses(self, guesses: list[int]) -> None:
        self.guesses = guesses[:self.max_guesses]
        self.num_tokens += len(self.guesses)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_tokens - len(self.guesses)] + self.guesses


@dataclass
class SchedulerOutput:
    """The per-step contract between the scheduler and the model runner."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
