"""BlockPool and KVCacheManager: on-demand growth, release, refcounted sharing for n > 1, no leaks."""

from __future__ import annotations

import pytest

from gpu_worker.engine.block_pool import BlockPool
from gpu_worker.engine.kv_cache_manager import KVCacheManager
from gpu_worker.engine.sampling_params import SamplingParams
from gpu_worker.engine.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id, f"req-{seq_id}", 0, list(range(100, 100 + prompt_len)), prompt_len,
                    SamplingParams(), seed=seq_id, arrival=seq_id)


def grow(kv: KVCacheManager, seq: Sequence, num_tokens: int) -> bool:
    """What one scheduled step does to the cache: make room for `num_tokens`, then mark them computed."""
    ok = kv.allocate_slots(seq, num_tokens)
    if ok:
        seq.num_computed_tokens += num_tokens
    return ok


def test_blocks_are_allocated_only_when_a_sequence_crosses_a_block_boundary():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a, b = make_seq(1, 5), make_seq(2, 3)
    assert grow(kv, a, 5)
    assert kv.block_tables(a)[0] == [0, 1]
    assert grow(kv, b, 3)
    assert kv.block_tables(b)[0] == [2]
    for _ in range(3):  # tokens 6..8 of `a` fit in its second block
        assert grow(kv, a, 1)
    assert kv.block_tables(a)[0] == [0, 1]
    assert grow(kv, a, 1)  # token 9 opens a third block
    assert kv.block_tables(a)[0] == [0, 1, 3]
    assert kv.pool.num_used == 4 and kv.pool.num_free == 4


def test_freeing_a_sequence_returns_all_its_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a, b = make_seq(1, 9), make_seq(2, 4)
    grow(kv, a, 9)
    grow(kv, b, 4)
    kv.free(a)
    assert kv.pool.num_free == 7
    assert a.seq_id not in kv.tables
    assert kv.block_tables(b)[0] == [3]
    kv.free(b)
    assert kv.pool.num_free == 8 and kv.usage == 0.0
    assert sorted(kv.pool.allocate(8)) == list(range(8)), "every block must be allocatable again"


@pytest.mark.parametrize(("prompt_len", "shared_blocks"), [(1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (10, 2)])
def test_fork_shares_full_prompt_blocks_but_leaves_at_least_one_token_to_compute(prompt_len, shared_blocks):
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent, child = make_seq(1, prompt_len), make_seq(2, prompt_len)
    grow(kv, parent, prompt_len)
    skipped = kv.fork(parent, child)
    assert skipped == shared_blocks * BLOCK_SIZE
    assert skipped < prompt_len
    assert kv.block_tables(child)[0] == kv.block_tables(parent)[0][:shared_blocks]
    assert kv.pool.num_used == len(kv.block_tables(parent)[0]), "sharing must not allocate new blocks"


def test_shared_blocks_are_freed_only_when_both_sequences_are_freed():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent, child = make_seq(1, 10), make_seq(2, 10)
    grow(kv, parent, 10)  # blocks 0, 1 full, block 2 partial
    child.num_computed_tokens = kv.fork(parent, child)
    assert grow(kv, child, 10 - child.num_computed_tokens)
    assert kv.block_tables(child)[0] == [0, 1, 3]
    assert kv.pool.num_used == 4

    kv.free(parent)
    assert kv.pool.num_used == 3, "only the parent's private block 2 may be freed"
    other = make_seq(3, 20)
    assert grow(kv, other, 20), "the 5 free blocks are usable"
    assert not set(kv.block_tables(other)[0]) & {0, 1, 3}, "blocks the child still holds must not be handed out"

    kv.free(child)
    kv.free(other)
    assert kv.pool.num_free == 8


def test_partial_block_waste_is_less_than_one_block_per_sequence():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE)
    seqs = [make_seq(i, prompt_len) for i, prompt_len in enumerate([1, 3, 4, 7, 13])]
    for seq in seqs:
        grow(kv, seq, seq.num_prompt_tokens)
    for _ in range(10):  # decode one token at a time
        for seq in seqs:
            grow(kv, seq, 1)
            waste = kv.partial_block_waste([seq])
            assert 0 <= waste <= BLOCK_SIZE - 1
            assert waste == -seq.num_computed_tokens % BLOCK_SIZE
    assert kv.partial_block_waste(seqs) <= len(seqs) * (BLOCK_SIZE - 1)


def test_a_forked_child_wastes_nothing_until_it_computes():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent, child = make_seq(1, 10), make_seq(2, 10)
    grow(kv, parent, 10)
    child.num_computed_tokens = kv.fork(parent, child)
    assert kv.partial_block_waste([child]) == 0


def test_failed_allocation_returns_false_and_allocates_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a, b = make_seq(1, 8), make_seq(2, 9)
    assert grow(kv, a, 8)
    assert not kv.allocate_slots(a, 8), "16 tokens need 4 blocks; only 3 exist"
    assert kv.block_tables(a)[0] == [0, 1]
    assert not kv.allocate_slots(b, 9), "9 tokens need 3 blocks; 1 is free"
    assert kv.tables.get(b.seq_id, []) == []
    assert kv.pool.num_free == 1
    assert kv.allocate_slots(b, 4), "the free block is still there after the failures"


def test_pool_refuses_to_allocate_more_than_is_free():
    pool = BlockPool(2)
    with pytest.raises(MemoryError):
        pool.allocate(3)
    assert pool.num_free == 2


def test_releasing_a_block_more_often_than_it_was_taken_raises():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    pool.release(blocks)
    assert pool.num_free == 2, "a block still referenced once must stay in use"
    pool.release(blocks)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(blocks)


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError):
        BlockPool(0)
