"""KV-cache groups: a hybrid model's sliding layers keep their window's blocks while its full layers keep every
block, each group with block tables of its own over one pool; a prefix hit holds in every group."""

from __future__ import annotations

import pytest

from gpu_worker.engine.kv_cache_groups import KVCacheGroup, KVCacheLayout
from gpu_worker.engine.kv_cache_manager import FREED, KVCacheManager, cdiv
from tests.gpu_worker.engine.test_block_pool import grow, make_seq

BLOCK_SIZE = 4
WINDOW = 8


def _gemma3_windows(num_layers: int) -> list[int | None]:
    """Gemma 3's pattern: five sliding layers, then a full one."""
    return [None if (i + 1) % 6 == 0 else 512 for i in range(num_layers)]


def test_layers_that_attend_alike_are_one_group_spanning_every_layer():
    layout = KVCacheLayout.of_windows([None] * 4)
    assert layout.groups == (KVCacheGroup((0, 1, 2, 3), None),)
    assert layout.num_slots == 4 and layout.caches_by_layer(["a", "b", "c", "d"]) == ["a", "b", "c", "d"]


def test_a_hybrid_model_is_grouped_by_window_in_groups_of_its_smallest_kinds_size_full_attention_first():
    layout = KVCacheLayout.of_windows(_gemma3_windows(12))
    assert layout.groups[0] == KVCacheGroup((5, 11), None)
    assert [g.layers for g in layout.groups[1:]] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert layout.windows == [None] + [512] * 5 and layout.num_slots == 2


def test_a_layer_shares_its_cache_tensor_with_the_layers_at_its_place_in_the_other_groups():
    layout = KVCacheLayout.of_windows(_gemma3_windows(12))
    caches = layout.caches_by_layer(["slot0", "slot1"])
    assert [caches[i] for i in (5, 0, 2, 4, 7, 9)] == ["slot0"] * 6
    assert [caches[i] for i in (11, 1, 3, 6, 8, 10)] == ["slot1"] * 6
    assert layout.group_of_layer[4] == layout.group_of_layer[6] == 3


def test_a_kind_that_does_not_divide_evenly_ends_in_a_smaller_group():
    layout = KVCacheLayout.of_windows([None] * 3 + [64] * 7)
    assert [len(g.layers) for g in layout.groups] == [3, 3, 3, 1] and layout.num_slots == 3


def test_sliding_groups_hold_their_windows_blocks_while_the_full_group_holds_every_block():
    kv = KVCacheManager(num_blocks=256, block_size=BLOCK_SIZE, windows=[None, WINDOW, WINDOW])
    seq = make_seq(1, 200)
    while seq.num_computed_tokens < 200:
        assert grow(kv, seq, 3)
    full, *sliding = kv.block_tables(seq)
    length = cdiv(seq.num_computed_tokens, BLOCK_SIZE)
    assert FREED not in full and len(full) == length
    for table in sliding:
        live = [b for b in table if b != FREED]
        assert len(table) == length and len(live) <= cdiv(WINDOW - 1 + 3, BLOCK_SIZE) + 1
    assert kv.pool.num_used == kv.num_held_blocks(seq) < length + 2 * 5
    kv.free(seq)
    assert kv.pool.num_free == 256


def test_groups_never_hand_out_the_same_block_twice():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, windows=[None, WINDOW])
    seqs = [make_seq(i, 30) for i in range(3)]
    for _ in range(10):
        for seq in seqs:
            assert grow(kv, seq, 3)
    live = [b for s in seqs for table in kv.block_tables(s) for b in table if b != FREED]
    assert len(live) == len(set(live)) == kv.pool.num_used


def test_an_allocation_every_group_cannot_make_fails_whole():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE, windows=[None, WINDOW])
    seq = make_seq(1, 12)
    assert not kv.allocate_slots(seq, 12), "3 blocks in each of 2 groups: 6, and 5 exist"
    assert kv.pool.num_free == 5
    assert kv.allocate_slots(seq, 8)


def _cached_run(kv: KVCacheManager, seq, chunk: int = 3) -> None:
    while seq.num_computed_tokens < seq.num_tokens:
        assert grow(kv, seq, min(chunk, seq.num_tokens - seq.num_computed_tokens))
        kv.cache_full_blocks(seq)


def test_a_prefix_hit_needs_only_the_windows_blocks_in_a_sliding_group():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, windows=[None, WINDOW])
    first = make_seq(1, 40)
    _cached_run(kv, first)
    # Take every free block: the sliding group's blocks that fell out of the window are evicted from the cache.
    filler = kv.pool.allocate(kv.pool.num_free)
    kv.pool.release(filler)
    kv.free(first)
    second = make_seq(2, 48)  # the first's 40 tokens and 8 more
    hit = kv.reuse_cached_prefix(second)
    assert hit == 40, "the first sequence's 10 blocks"
    full, sliding = kv.block_tables(second)
    assert FREED not in full and len(full) == len(sliding) == 10
    first_needed = (hit - WINDOW + 1) // BLOCK_SIZE
    assert sliding[:first_needed] == [FREED] * first_needed and FREED not in sliding[first_needed:]


def test_a_prefix_hit_ends_before_a_window_a_sliding_group_no_longer_holds():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, windows=[None, WINDOW])
    first = make_seq(1, 40)
    _cached_run(kv, first, chunk=40)  # one chunk: its sliding blocks all held until it ends
    untouched = kv.pool.num_free
    kv.free(first)
    # The free list now ends in the first sequence's blocks, its tail first: take the sliding group's last block.
    kv.pool.allocate(untouched + 1)
    longer = make_seq(2, 50)  # the first's 40 tokens and 10 more: 10 cached blocks in the full group
    assert kv.reuse_cached_prefix(longer) == 36, "the window before token 40 needs block 9, evicted: 9 blocks hit"


def test_preempting_a_sequence_returns_its_blocks_in_every_group():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, windows=[None, WINDOW, WINDOW])
    seq = make_seq(1, 60)
    _cached_run(kv, seq)
    kv.free(seq)
    seq.num_computed_tokens = 0
    assert kv.pool.num_free == 64
    assert kv.reuse_cached_prefix(seq) == 56 and kv.num_held_blocks(seq) == 14 + 2 * 2


def test_a_fork_shares_each_groups_blocks_when_every_window_is_still_held():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, windows=[None, WINDOW])
    parent, child = make_seq(1, 13), make_seq(2, 13)
    assert grow(kv, parent, 13)  # one chunk: nothing freed yet
    assert kv.fork(parent, child) == 12
    assert [t[:3] for t in kv.block_tables(parent)] == kv.block_tables(child)


def test_a_sequence_needs_every_block_of_a_full_group_and_a_window_and_a_chunk_of_a_sliding_one():
    layout = KVCacheLayout.of_windows([None, 64, 64])
    assert layout.blocks_for(1024, 16, chunk=32) == 64 + 2 * (-(-(63 + 32) // 16) + 2)
    assert KVCacheLayout.of_windows([4096]).blocks_for(1024, 16, chunk=2048) == 64  # never more than the length


def test_a_separate_draft_model_for_a_target_whose_every_layer_slides_is_refused_by_name(make_checkpoint):
    from gpu_worker.engine import LLM, ModelLoadError

    target, draft = make_checkpoint("mistral-sliding"), make_checkpoint("llama")
    with pytest.raises(ModelLoadError, match="full-attention layers"):
        LLM(str(target), dtype="float32", speculative={"method": "draft", "model": str(draft),
                                                       "num_speculative_tokens": 2})


def test_a_window_no_sequence_outgrows_is_grouped_as_full_attention(make_checkpoint):
    from gpu_worker.engine import LLM

    llm = LLM(str(make_checkpoint("gemma3")), dtype="float32", max_model_len=32)  # its window: 40 tokens
    assert llm.engine.kv_layout.windows == [None]
