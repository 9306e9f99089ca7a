"""Decides, each step, which tokens of which sequences run: integers and queues only, never tensors.

One token budget per step mixes decode tokens of running sequences with prefill chunks of new or partly
prefilled ones (chunked prefill); there are no separate prefill and decode phases. When KV blocks run out,
the lowest-priority, newest running sequence is preempted by recompute and goes back to the queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kv_cache_manager import KVCacheManager
from .scheduler_output import ScheduledChunk, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .speculative import NoProposer, Proposer, SpeculationStats, record_kept


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # A waiting sequence gains one priority level per this many steps, so low priority never starves.
    priority_aging_steps: int = 1000


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, proposer: Proposer | None = None):
        self.config = config
        self.kv = kv
        self.proposer = proposer or NoProposer()
        self.speculation = SpeculationStats()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._step = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.enqueued_step = self._step
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        for pending in seq.forks_pending:
            self.abort(pending)
        seq.forks_pending.clear()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        if not seq.is_finished:
            seq.finish("abort")

    def _waiting_key(self, seq: Sequence) -> tuple[int, int]:
        aged = (self._step - seq.enqueued_step) // self.config.priority_aging_steps
        return (seq.priority - aged, seq.arrival)

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._schedule_waiting(out, budget)
        self._add_guesses(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.running.sort(key=lambda s: (s.priority, s.arrival))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n, out):
                continue  # `seq` itself was preempted
            out.chunks.append(self._chunk(seq, n))
            budget -= n
            i += 1
        return budget

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Slots for `n` more tokens of `seq`, preempting the lowest-priority, newest running sequences until they
        fit; False when `seq` itself had to go."""
        while not self.kv.allocate_slots(seq, n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _add_guesses(self, out: SchedulerOutput, budget: int) -> None:
        """Guesses for the step's decoding sequences out of what it leaves: the budget after every sequence's own
        tokens, and free blocks only, so that guessing never costs another sequence its blocks or a prefill its
        turn. The proposer is asked once, for all of them."""
        guessing = []
        for chunk in out.chunks:
            seq = chunk.seq
            if budget > 0 and chunk.num_tokens == 1 and chunk.sample and (k := self._max_guesses(seq, budget)) \
                    and self.kv.allocate_slots(seq, 1 + k):
                chunk.max_guesses, chunk.block_tables = k, self.kv.block_tables(seq)
                guessing.append(chunk)
                budget -= k
        if guessing:
            for chunk, guesses in zip(guessing, self.proposer.propose(guessing), strict=True):
                chunk.add_guesses(guesses)

    def _max_guesses(self, seq: Sequence, budget: int) -> int:
        """How many guesses a decoding sequence may get: what the proposer would give it, no more than the step's
        budget, its max_tokens and the model's length leave room for after the token the step samples anyway;
        none in a large batch."""
        if seq.forks_pending or len(self.running) > self.proposer.max_batch:
            return 0
        room = min(budget, seq.params.max_tokens - seq.num_output_tokens, self.config.max_model_len - seq.num_tokens)
        return self.proposer.max_guesses(seq, room - 1)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        self.waiting.sort(key=self._waiting_key)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self.kv.reuse_cached_prefix(seq) if seq.num_computed_tokens == 0 else 0
            seq.num_computed_tokens += hit
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.allocate_slots(seq, n):
                self.kv.free(seq)  # the cached blocks go back to the free list, still cached
                seq.num_computed_tokens -= hit
                break
            self.kv.count_prefix_query(seq, hit)
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = hit
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(self._chunk(seq, n))
            budget -= n
        return budget

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(seq, start, n, self.kv.block_tables(seq), sample=start + n == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = seq.num_draft_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.enqueued_step = self._step
        self.waiting.append(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput, sampled: dict[int, list[int]],
               eos_token_ids: frozenset[int]) -> dict[int, int]:
        """Advance sequences by what ran, append sampled tokens (a chunk with guesses may bring several: the
        guesses kept, then the model's own), fork n > 1 samples, free finished ones. A stop within the tokens
        drops those after it. Returns how many of its sampled tokens each sequence took."""
        taken = {}
        for chunk in out.chunks:
            seq = chunk.seq
            appended = 0
            if chunk.sample:
                tokens = sampled[seq.seq_id]
                if chunk.guesses:
                    self.speculation.record(len(chunk.guesses), len(tokens) - 1)
                    record_kept(seq, len(chunk.guesses), len(tokens) - 1)
                for token in tokens:
                    seq.token_ids.append(token)
                    appended += 1
                    seq.check_token_stop(eos_token_ids, self.config.max_model_len)
                    if seq.is_finished:
                        break
                taken[seq.seq_id] = appended
            # The step wrote KV for the chunk's tokens; of its guesses, only those now in the sequence before its
            # last token count. The others' slots are overwritten when those positions run again.
            seq.num_computed_tokens += chunk.num_tokens - len(chunk.guesses) + max(appended - 1, 0)
            seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_computed_tokens)
            self.kv.cache_full_blocks(seq)
            if seq.forks_pending and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._fork_pending(seq)
        self.release_finished()
        return taken

    def _fork_pending(self, parent: Sequence) -> None:
        """Forks join the running set, where preemption can reclaim their blocks; a fork left waiting with
        shared blocks could hold them behind a request that does not fit. With no room to run, a sample
        starts unshared, like any new request."""
        for child in parent.forks_pending:
            if len(self.running) < self.config.max_num_seqs:
                child.num_computed_tokens = self.kv.fork(parent, child)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
            else:
                self.add(child)
        parent.forks_pending.clear()

    def release_finished(self) -> None:
        finished = [s for s in self.running if s.is_finished]
        for seq in finished:
            for child in seq.forks_pending:  # a parent that never prefilled: its samples start unshared
                self.add(child)
            seq.forks_pending.clear()
            self.running.remove(seq)
            self.kv.free(seq)
