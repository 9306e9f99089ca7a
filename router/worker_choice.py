"""Which worker of a model serves a request: the one whose prefix cache saves the most prompt compute,
net of the queue it would wait in.

    score(w) = cached_tokens(w) if cached_tokens(w) >= min_prefix_tokens else 0
               - load_cost_tokens * load(w)

A cached prefix saves recomputing its tokens; each request already queued or running on a worker delays
this one about as much as computing `load_cost_tokens` prompt tokens. So a popular system prompt draws
its requests to the worker holding it only while that worker's extra load is worth less than the prefix:
beyond that the flood spills over, the second worker caches the prefix too, and both then share it (a
router that always follows the cache pins one hot prefix to one worker). Ties go to the less loaded
worker, then to a rendezvous hash of the prompt's first block, so a new prefix lands on one worker.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    load: int  # requests running or waiting there, including those routed since its last heartbeat


@dataclass(frozen=True)
class WorkerChoice:
    worker_id: str
    cached_tokens: int  # of the prompt, in the chosen worker's prefix cache
    reason: str


@dataclass(frozen=True)
class WorkerChooser:
    min_prefix_tokens: int
    load_cost_tokens: int

    def choose(self, workers: list[WorkerLoad], cached_tokens: dict[str, int], affinity_key: int) -> WorkerChoice:
        """`workers`: non-empty; `cached_tokens`: per worker id (absent = 0); `affinity_key`: the prompt's
        first block hash (any int standing for the prompt's start)."""

        def useful(w: WorkerLoad) -> int:
            cached = cached_tokens.get(w.worker_id, 0)
            return cached if cached >= self.min_prefix_tokens else 0

        def rank(w: WorkerLoad) -> tuple:
            return (useful(w) - self.load_cost_tokens * w.load, -w.load, _rendezvous(affinity_key, w.worker_id))

        best = max(workers, key=rank)
        least = min(w.load for w in workers)
        if useful(best):
            reason = f"prefix {useful(best)} cached tokens, load {best.load} (least {least})"
        else:
            reason = f"no useful cached prefix; load {best.load} (least {least})"
        return WorkerChoice(best.worker_id, cached_tokens.get(best.worker_id, 0), reason)


@dataclass
class RoundRobinChooser:
    """The baseline `tokenfleet bench routing` compares against: each worker in turn, blind to caches and load."""

    turn: int = 0

    def choose(self, workers: list[WorkerLoad], cached_tokens: dict[str, int], affinity_key: int) -> WorkerChoice:
        worker = workers[self.turn % len(workers)]
        self.turn += 1
        return WorkerChoice(worker.worker_id, cached_tokens.get(worker.worker_id, 0), "round robin")


def _rendezvous(key: int, worker_id: str) -> int:
    digest = hashlib.blake2b(f"{key}:{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
