"""Prefix caching: full blocks keyed by their whole prefix, reused on a hit, evicted least recently freed
first (a request's tail before its head), and outputs identical with caching on and off."""

from __future__ import annotations

import pytest

from gpu_worker.engine import LLM, SamplingParams
from gpu_worker.engine.kv_cache_manager import KVCacheManager
from gpu_worker.engine.sequence import Sequence

BS = 4


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens), SamplingParams(), seed=0, arrival=seq_id)


def _run_prefill(kv: KVCacheManager, seq: Sequence) -> int:
    """What the scheduler does for a new sequence: reuse its cached prefix, compute the rest, register."""
    hit = kv.reuse_cached_prefix(seq)
    seq.num_computed_tokens = hit
    assert kv.allocate_slots(seq, seq.num_tokens - hit)
    kv.count_prefix_query(seq, hit)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return hit


def test_a_second_request_with_the_same_prefix_reuses_its_full_blocks_and_counts_the_hit():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first = _seq(1, list(range(10)))  # blocks [0-3] [4-7] and a partial [8, 9]
    assert _run_prefill(kv, first) == 0 and kv.block_tables(first)[0] == [0, 1, 2]
    second = _seq(2, list(range(8)) + [50, 51, 52])
    assert _run_prefill(kv, second) == 8
    assert kv.block_tables(second)[0][:2] == [0, 1] and kv.block_tables(second)[0][2] == 3
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (21, 8)


def test_a_prefix_matches_only_from_the_start_token_for_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    _run_prefill(kv, _seq(1, list(range(12))))
    assert _run_prefill(kv, _seq(2, [99] + list(range(1, 12)))) == 0  # first block differs: nothing after counts
    assert _run_prefill(kv, _seq(3, list(range(4)) + [99] + list(range(5, 12)))) == 4


def test_at_least_one_token_is_left_to_compute_even_on_a_full_hit():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    _run_prefill(kv, _seq(1, list(range(8))))
    assert _run_prefill(kv, _seq(2, list(range(8)))) == 4


def test_freed_cached_blocks_are_reused_until_evicted_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    first = _seq(1, list(range(13)))  # 3 full blocks + 1 partial: the whole pool
    _run_prefill(kv, first)
    kv.free(first)
    assert kv.pool.num_free == 4 and kv.pool.num_cached == 3
    other = _seq(2, [90, 91, 92, 93, 94])  # needs 2 blocks: the partial one, then the tail full block (2)
    _run_prefill(kv, other)
    assert sorted(kv.block_tables(other)[0]) == [2, 3] and kv.pool.num_evicted == 1
    kv.free(other)
    assert _run_prefill(kv, _seq(3, list(range(9)))) == 8  # the head blocks 0 and 1 survived


def test_a_shared_system_prompt_occupies_its_blocks_once_across_sixteen_requests():
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    system = list(range(1000, 1016))  # 4 full blocks
    seqs = [_seq(i, system + [i, i + 1]) for i in range(16)]
    for seq in seqs:
        _run_prefill(kv, seq)
    assert all(kv.block_tables(s)[0][:4] == kv.block_tables(seqs[0])[0][:4] for s in seqs)
    assert kv.pool.num_used == 4 + 16


def test_a_salted_prefix_hits_only_requests_with_the_same_salt():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(9))

    def salted(seq_id: int, salt: str | None) -> Sequence:
        seq = _seq(seq_id, tokens)
        seq.cache_salt = salt
        return seq

    _run_prefill(kv, salted(1, "tenant-a"))
    assert _run_prefill(kv, salted(2, "tenant-b")) == 0
    assert _run_prefill(kv, salted(3, None)) == 0
    assert _run_prefill(kv, salted(4, "tenant-a")) == 8


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return str(make_checkpoint("llama"))


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe", "gemma3", "gpt-oss"])  # the last two: windows of 40 tokens
@pytest.mark.parametrize("budget", [2048, 32], ids=["whole-prefill", "chunked-prefill"])
def test_outputs_are_identical_with_prefix_caching_on_and_off(make_checkpoint, arch, budget):
    checkpoint = str(make_checkpoint(arch))
    system = list(range(3, 70))
    prompts = [system + [100 + i, 200 + i] for i in range(8)] + [system[:40] + [7] * i for i in range(1, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)]
    outputs = {}
    for caching in (True, False):
        llm = LLM(model=checkpoint, dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=budget,
                  enable_prefix_caching=caching, block_size=16)
        runs = [llm.generate(prompts, p) for p in params]
        runs.append(llm.generate(prompts, params[0]))  # the second round hits what the first cached
        outputs[caching] = [[o.token_ids for o in run] for run in runs]
        stats = llm.engine.stats()
        assert (stats["prefix_cache_hits"] > 0) == caching
        assert llm.engine.kv.pool.num_used == 0
    assert outputs[True] == outputs[False]


def test_blocks_entering_and_leaving_the_cache_are_logged_by_their_chained_hash():
    from services.text.block_hash import block_hashes

    kv = KVCacheManager(num_blocks=3, block_size=BS)
    first = _seq(1, list(range(9)))  # two full blocks and a partial one: the whole pool
    _run_prefill(kv, first)
    kv.free(first)
    hashes = block_hashes(list(range(9)), BS)
    assert kv.pool.events.drain() == ([(True, hashes[0]), (True, hashes[1])], False)
    _run_prefill(kv, _seq(2, [70, 71, 72, 73, 74]))  # takes the partial block, then evicts the tail block
    assert kv.pool.events.drain()[0][0] == (False, hashes[1])


def test_a_salted_prompt_hashes_to_other_blocks():
    from services.text.block_hash import block_hashes

    assert block_hashes(list(range(8)), BS, "tenant-a") != block_hashes(list(range(8)), BS)
    assert block_hashes(list(range(8)), BS, "tenant-a") == block_hashes(list(range(8)), BS, "tenant-a")


def test_prefixes_whose_python_hashes_collide_get_different_block_ids():
    # 1 and 2**61 hash equally in CPython (ints hash modulo 2**61 - 1): a chain through Python's 64-bit
    # hash gave these prompts the same ids, so the prefix directory credited one with the other's blocks.
    assert hash((0, (1, 2, 3, 4))) == hash((0, (2**61, 2, 3, 4)))
    from services.text.block_hash import block_hashes

    first, second = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS), block_hashes([2**61, 2, 3, 4, 5, 6, 7, 8], BS)
    assert first[0] != second[0] and first[1] != second[1]


def test_prefixes_whose_python_hashes_collide_share_no_block():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    _run_prefill(kv, _seq(1, [1, 2, 3, 4] + [5, 6, 7, 8] + [9]))
    assert _run_prefill(kv, _seq(2, [2**61, 2, 3, 4] + [5, 6, 7, 8] + [9])) == 0


def test_an_event_log_nobody_drains_stays_bounded_and_says_it_overflowed():
    from gpu_worker.engine.block_pool import KVEventLog

    log = KVEventLog(max_events=4)
    for i in range(6):
        log.record(True, bytes([i]) * 32)
    events, overflowed = log.drain()
    assert overflowed and len(events) <= 4
    assert log.drain() == ([], False)


def test_the_offline_api_reports_the_prompt_tokens_served_from_the_prefix_cache(checkpoint):
    llm = LLM(model=checkpoint, dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=16)
    prompt = list(range(3, 40))  # two full blocks of 16, then 5 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert llm.generate(prompt, params)[0].num_cached_tokens == 0
    assert llm.generate(prompt, params)[0].num_cached_tokens == 32


def test_on_cpu_a_kv_block_holds_128_tokens_unless_asked_otherwise(checkpoint):
    llm = LLM(model=checkpoint, dtype="float32", kv_cache_memory_bytes=8 << 20)
    prompt = list(range(3, 303))  # two whole blocks of 128, then 44 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompt, params)
    assert llm.engine.block_size == 128 and llm.generate(prompt, params)[0].num_cached_tokens == 256
