"""Scheduler: token budget and chunked prefill, decodes first, priorities and aging, preemption, finishing."""

from __future__ import annotations

import pytest

from gpu_worker.engine.kv_cache_manager import KVCacheManager
from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.engine.scheduler import Scheduler, SchedulerConfig
from gpu_worker.engine.scheduler_output import SchedulerOutput
from gpu_worker.engine.sequence import Sequence, SequenceStatus
from gpu_worker.engine.speculative import Proposer

TOKEN = 7  # every fake sample, unless a test says otherwise


def make_seq(seq_id: int, prompt_len: int, *, priority: int = 0, arrival: int | None = None,
             **params) -> Sequence:
    return Sequence(seq_id, f"req-{seq_id}", 0, list(range(100, 100 + prompt_len)), prompt_len,
                    SamplingParams(**params), seed=seq_id, priority=priority,
                    arrival=seq_id if arrival is None else arrival)


def make_scheduler(num_blocks: int = 256, block_size: int = 4, prefix_caching: bool = False, **config) -> Scheduler:
    """Prefix caching off unless asked: these fake prompts all share their first tokens."""
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size, prefix_caching))


def step(sched: Scheduler, token: int = TOKEN, eos: frozenset[int] = frozenset()) -> SchedulerOutput:
    """One engine step without a model: every chunk that asks for a sample gets `token`."""
    out = sched.schedule()
    sched.update(out, {c.seq.seq_id: [token] for c in out.chunks if c.sample}, eos_token_ids=eos)
    return out


def scheduled(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    return [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks]


def test_long_prompt_is_prefilled_in_budget_sized_chunks_and_samples_after_the_last():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add(make_seq(1, 100))
    chunks = [step(sched).chunks[0] for _ in range(5)]
    assert [(c.start, c.num_tokens, c.sample) for c in chunks] == [
        (0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True), (100, 1, True)]


def test_running_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add(make_seq(1, 4, priority=5))
    step(sched)
    sched.add(make_seq(2, 100, priority=-5))  # a more urgent newcomer still waits behind running decodes
    assert scheduled(step(sched)) == [(1, 4, 1), (2, 0, 31)]


def test_no_step_exceeds_the_token_budget_or_max_num_seqs():
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3)
    for i, prompt_len in enumerate([5, 40, 1, 17, 9, 3], start=1):
        sched.add(make_seq(i, prompt_len, max_tokens=4))
    while sched.has_unfinished:
        out = step(sched)
        assert 0 < out.num_tokens <= 16
        assert len(out.chunks) <= 3 and len(sched.running) <= 3


def test_max_num_seqs_keeps_extra_sequences_waiting_until_one_finishes():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq(1, 4, max_tokens=1), make_seq(2, 4, max_tokens=5), make_seq(3, 4)
    for seq in (a, b, c):
        sched.add(seq)
    assert [ch.seq for ch in step(sched).chunks] == [a, b]
    assert c.status is SequenceStatus.WAITING
    assert [ch.seq for ch in step(sched).chunks] == [b, c], "a finished, which makes room for c"


def test_waiting_sequences_run_by_priority_value_then_arrival():
    sched = make_scheduler(max_num_seqs=1)
    for seq_id, priority, arrival in [(1, 1, 0), (2, 0, 2), (3, 0, 1), (4, -1, 3)]:
        sched.add(make_seq(seq_id, 4, priority=priority, arrival=arrival, max_tokens=1))
    order = [step(sched).chunks[0].seq.seq_id for _ in range(4)]
    assert order == [4, 3, 2, 1]


def test_aging_lets_a_low_priority_sequence_overtake_a_stream_of_urgent_arrivals():
    sched = make_scheduler(max_num_seqs=1, priority_aging_steps=2)
    low = make_seq(1, 4, priority=3, arrival=0, max_tokens=1)
    sched.add(low)
    ran_at = None
    for i in range(2, 40):
        sched.add(make_seq(i, 4, priority=0, max_tokens=1))
        out = step(sched)
        if low in [c.seq for c in out.chunks]:
            ran_at = i - 1
            break
    assert ran_at is not None, "the low-priority sequence starved"
    assert 1 < ran_at <= 8, "it must first yield to the urgent ones, then age past them (3 levels x 2 steps)"


def fill_pool_with_three_sequences(priorities: list[int]) -> tuple[Scheduler, list[Sequence]]:
    """Six blocks of 4 tokens, three 8-token prompts: the pool is full, the next decodes need blocks."""
    sched = make_scheduler(num_blocks=6, block_size=4)
    seqs = [make_seq(i, 8, priority=p, max_tokens=2) for i, p in enumerate(priorities, start=1)]
    for seq in seqs:
        sched.add(seq)
    step(sched)
    assert sched.kv.pool.num_free == 0
    return sched, seqs


@pytest.mark.parametrize(("priorities", "victim"), [([0, 1, 0], 1), ([0, 0, 0], 2), ([1, 0, 0], 0)])
def test_out_of_blocks_preempts_the_lowest_priority_then_newest_running_sequence(priorities, victim):
    sched, seqs = fill_pool_with_three_sequences(priorities)
    out = step(sched)
    assert out.preempted == [seqs[victim]]
    assert sched.num_preemptions == 1
    assert seqs[victim].num_computed_tokens == 0
    assert seqs[victim].token_ids == list(range(100, 108)) + [TOKEN], "preemption keeps the tokens"
    assert seqs[victim].status is SequenceStatus.WAITING and seqs[victim] in sched.waiting
    assert sorted(c.seq.seq_id for c in out.chunks) == sorted(s.seq_id for s in seqs if s is not seqs[victim])


def test_preempted_sequence_recomputes_all_its_tokens_and_resumes():
    sched, (_, b, _) = fill_pool_with_three_sequences([0, 1, 0])
    step(sched)  # b is preempted, a and c finish
    assert sched.running == [] and sched.waiting == [b]
    assert scheduled(step(sched)) == [(b.seq_id, 0, 9)]
    assert b.is_finished and b.output_token_ids == [TOKEN, TOKEN]
    assert sched.kv.pool.num_free == 6


def test_forked_sample_starts_after_the_shared_prompt_blocks():
    sched = make_scheduler(block_size=4)
    parent, child = make_seq(1, 10, max_tokens=2), make_seq(2, 10, max_tokens=2)
    parent.forks_pending = [child]
    sched.add(parent)
    step(sched)
    assert child in sched.running and child.num_computed_tokens == 8
    assert sched.kv.block_tables(child)[0] == sched.kv.block_tables(parent)[0][:2]
    assert scheduled(step(sched)) == [(1, 10, 1), (2, 8, 2)]


def test_forks_never_hold_shared_blocks_behind_a_request_that_does_not_fit():
    sched = make_scheduler(num_blocks=8, block_size=4)
    parent, child = make_seq(1, 20, max_tokens=6), make_seq(2, 20, max_tokens=6)
    parent.forks_pending = [child]
    sched.add(parent)
    step(sched)
    sched.add(make_seq(3, 16, priority=-1, max_tokens=2))  # urgent, and too big while both samples run
    while sched.has_unfinished:
        assert not step(sched).is_empty, "no progress: blocks held by sequences that cannot run"
    assert sched.kv.pool.num_free == 8


def test_abort_frees_blocks_and_finishes_the_sequence_and_its_pending_samples():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    seq, pending = make_seq(1, 20), make_seq(2, 20)
    seq.forks_pending = [pending]
    sched.add(seq)
    step(sched)
    assert sched.kv.pool.num_used == 2
    sched.abort(seq)
    assert sched.kv.pool.num_free == 16 and not sched.has_unfinished
    assert (seq.finish_reason, pending.finish_reason) == ("abort", "abort")


@pytest.mark.parametrize(("params", "samples", "max_model_len", "reason", "stop_reason"), [
    (dict(max_tokens=3), [7, 7, 7], 2048, "length", None),
    (dict(), [7, 2], 2048, "stop", None),  # 2 is eos
    (dict(max_tokens=3, ignore_eos=True), [2, 2, 2], 2048, "length", None),
    (dict(stop_token_ids=[8]), [7, 8], 2048, "stop", 8),
    (dict(stop_token_ids=[2], ignore_eos=True), [7, 2], 2048, "stop", 2),
    (dict(), [7, 7], 6, "length", None),  # 4 prompt + 2 output tokens fill the context
])
def test_sequence_finishes_on_its_stop_condition_and_releases_its_blocks(params, samples, max_model_len,
                                                                         reason, stop_reason):
    sched = make_scheduler(max_model_len=max_model_len)
    seq = make_seq(1, 4, **params)
    sched.add(seq)
    for token in samples:
        assert not seq.is_finished
        step(sched, token, eos=frozenset([2]))
    assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)
    assert seq.output_token_ids == samples
    assert not sched.has_unfinished and sched.kv.pool.num_free == sched.kv.pool.num_blocks


def test_pool_is_all_free_after_a_workload_with_chunks_forks_and_preemptions():
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=24, max_num_seqs=6)
    for i in range(1, 9):
        seq = make_seq(i, 3 + 7 * i % 29, priority=i % 3, max_tokens=5 + i)
        if i % 3 == 0:
            seq.forks_pending = [make_seq(100 + i, seq.num_prompt_tokens, max_tokens=4)]
        sched.add(seq)
    for _ in range(500):
        if not sched.has_unfinished:
            break
        step(sched)
        assert sched.kv.partial_block_waste(sched.running) <= len(sched.running) * 3
    assert not sched.has_unfinished
    assert sched.num_preemptions > 0, "the workload is meant to exercise preemption"
    assert sched.kv.pool.num_free == 24 and sched.kv.tables == {}


class FixedGuesses(Proposer):
    """Guesses `guesses` for every decoding sequence, as a draft model with its own cache would: its KV then
    covers the sequence's last token and every guess but the last."""

    def __init__(self, guesses: list[int]):
        super().__init__(len(guesses), max_batch=8)
        self.guesses = guesses

    def propose(self, chunks):
        for chunk in chunks:
            chunk.seq.num_draft_computed_tokens = chunk.start + chunk.max_guesses
        return [self.guesses[:c.max_guesses] for c in chunks]


def test_a_draft_caches_tokens_count_only_up_to_the_kept_guesses():
    sched = Scheduler(SchedulerConfig(), KVCacheManager(256, 4, False), FixedGuesses([1, 2, 3]))
    seq = make_seq(1, 10, max_tokens=20)
    sched.add(seq)
    step(sched)  # the prompt, and a first token
    out = sched.schedule()
    assert out.chunks[0].guesses == [1, 2, 3] and seq.num_draft_computed_tokens == 13
    sched.update(out, {1: [1, 9]}, eos_token_ids=frozenset())  # one guess kept, then the model's own token
    assert seq.token_ids[-2:] == [1, 9] and seq.num_computed_tokens == seq.num_draft_computed_tokens == 12


def test_guesses_take_only_blocks_no_sequence_needs_for_its_own_token():
    # 5 blocks of 4: after the prompts (7 and 8 tokens) one is free, and the second sequence's next token needs it.
    sched = Scheduler(SchedulerConfig(), KVCacheManager(5, 4, False), FixedGuesses([1, 2, 3]))
    first, second = make_seq(1, 7, max_tokens=20), make_seq(2, 8, max_tokens=20)
    sched.add(first)
    sched.add(second)
    step(sched)
    out = sched.schedule()
    assert not out.preempted and [c.seq.seq_id for c in out.chunks] == [1, 2]
    assert out.chunks[0].guesses == []  # the free block went to the second sequence's token (and its guesses)
