"""Sliding-window attention: each token sees itself and the window - 1 tokens before it; a sequence longer than the
window holds the window's blocks, not its whole length's. (Kernels against this reference:
test_sliding_window_kernels.py; models against HF: test_matches_hf.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.engine.attention import AttentionMetadata, HeadLayout, PrefillChunk, TorchPagedAttention
from gpu_worker.engine.kv_cache_manager import FREED, KVCacheManager, cdiv
from tests.gpu_worker.engine.test_block_pool import grow, make_seq

BLOCK_SIZE = 4
LENGTH = 23  # the sequence's tokens, all in the cache
HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)


def _sequence_in_cache(window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A cache [2, blocks, KVH, block_size, D] holding one sequence's keys and values through a shuffled block table
    whose entries out of the last token's window are FREED; returns (cache, keys, values, table)."""
    gen = torch.Generator().manual_seed(window)
    keys, values = (torch.randn(LENGTH, 2, 16, generator=gen) for _ in range(2))
    num_blocks = cdiv(LENGTH, BLOCK_SIZE)
    table = torch.randperm(2 * num_blocks, generator=gen)[:num_blocks].tolist()
    cache = torch.randn(2, 2 * num_blocks, 2, BLOCK_SIZE, 16, generator=gen)
    for p in range(LENGTH):
        cache[0, table[p // BLOCK_SIZE], :, p % BLOCK_SIZE] = keys[p]
        cache[1, table[p // BLOCK_SIZE], :, p % BLOCK_SIZE] = values[p]
    first_query = LENGTH - 7  # the prefill chunk's first row; the decode row is the last token
    past = max(0, first_query - window + 1) // BLOCK_SIZE
    return cache, keys, values, [FREED] * past + table[past:]


def _expected(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              window: int) -> torch.Tensor:
    """Attention over the whole sequence, masked to each query's window: [rows, H, D]."""
    seen = torch.arange(LENGTH)[None, :]
    mask = (seen <= positions[:, None]) & (seen > positions[:, None] - window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask, scale=0.25, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("window", [1, 5, 8, 30])
def test_a_decode_row_attends_to_its_last_window_tokens_only(window):
    cache, keys, values, table = _sequence_in_cache(window)
    meta = AttentionMetadata.decode_rows([table], [LENGTH], BLOCK_SIZE)
    q = torch.randn(1, 4, 16)
    got = TorchPagedAttention(HeadLayout(**HEADS, window=window)).decode(q, cache, meta)
    torch.testing.assert_close(got, _expected(q, keys, values, torch.tensor([LENGTH - 1]), window))


@pytest.mark.parametrize("window", [1, 5, 8, 30])
def test_each_row_of_a_prefill_chunk_attends_to_its_own_window(window):
    cache, keys, values, table = _sequence_in_cache(window)
    chunk = PrefillChunk(0, 7, LENGTH, torch.tensor(table))
    meta = AttentionMetadata(torch.zeros(7, dtype=torch.long), torch.zeros(7, dtype=torch.long), BLOCK_SIZE, [],
                             None, None, [chunk])
    q = torch.randn(7, 4, 16)
    out = torch.empty_like(q)
    TorchPagedAttention(HeadLayout(**HEADS, window=window)).prefill(q, keys[-7:], values[-7:], cache, meta, out)
    torch.testing.assert_close(out, _expected(q, keys, values, torch.arange(LENGTH - 7, LENGTH), window))


def test_a_window_inside_a_chunk_with_nothing_cached_masks_the_chunk_itself():
    keys, values, q = (torch.randn(9, h, 16) for h in (2, 2, 4))
    chunk = PrefillChunk(0, 9, 9, torch.tensor([0, 1, 2]))
    meta = AttentionMetadata(torch.zeros(9, dtype=torch.long), torch.zeros(9, dtype=torch.long), BLOCK_SIZE, [],
                             None, None, [chunk])
    cache = torch.zeros(2, 3, 2, BLOCK_SIZE, 16)
    for p in range(9):
        cache[0, p // BLOCK_SIZE, :, p % BLOCK_SIZE], cache[1, p // BLOCK_SIZE, :, p % BLOCK_SIZE] = keys[p], values[p]
    out = torch.empty_like(q)
    TorchPagedAttention(HeadLayout(**HEADS, window=3)).prefill(q, keys, values, cache, meta, out)
    seen = torch.arange(9)
    mask = (seen[None, :] <= seen[:, None]) & (seen[None, :] > seen[:, None] - 3)
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                          values.transpose(0, 1)[None], attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, want[0].transpose(0, 1))


def test_a_sequence_far_past_the_window_holds_the_windows_blocks_and_gives_the_rest_back():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, windows=[10])
    seq = make_seq(1, 200)
    held = []
    while seq.num_computed_tokens < 200:
        assert grow(kv, seq, 3)  # chunks of 3 tokens
        held.append(kv.num_held_blocks(seq))
    # the next chunk's first query sees the 9 tokens before it, which span at most 3 blocks (plus the chunk's own)
    assert max(held) <= cdiv(10 - 1 + 3, BLOCK_SIZE) + 1
    table = kv.block_tables(seq)[0]
    live = [b for b in table if b != FREED]
    assert table[:len(table) - len(live)] == [FREED] * (len(table) - len(live))  # freed entries lead
    assert kv.pool.num_used == len(live)
    kv.free(seq)
    assert kv.pool.num_free == 64


def test_without_a_window_a_sequence_keeps_every_block():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE)
    seq = make_seq(1, 200)
    while seq.num_computed_tokens < 200:
        grow(kv, seq, 4)
    assert kv.num_held_blocks(seq) == 50 and FREED not in kv.block_tables(seq)[0]


def test_a_child_forked_past_the_window_recomputes_its_prompt_rather_than_read_a_freed_block():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, windows=[6])
    parent, child = make_seq(1, 40), make_seq(2, 40)
    while parent.num_computed_tokens < 40:
        grow(kv, parent, 3)
    skipped = kv.fork(parent, child)
    first_needed = max(0, skipped - 6 + 1) // BLOCK_SIZE
    assert FREED not in kv.block_tables(child)[0][first_needed:]
    child.num_computed_tokens = skipped
    while child.num_computed_tokens < 40:
        assert grow(kv, child, 3)
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free == 64


def test_an_engine_serving_a_sliding_model_holds_about_one_window_of_kv_at_eight_windows(make_checkpoint):
    """`tokenfleet bench kv-window`'s figure, on a small model: KV in use at 8x the window <= 1.25x at 1x."""
    from bench.kv_window import peak_layer_blocks
    from gpu_worker.engine import LLM

    llm = LLM(str(make_checkpoint("mistral", sliding_window=64)), dtype="float32", block_size=8,
              enable_prefix_caching=False, kv_cache_memory_bytes=8 << 20)
    peaks = peak_layer_blocks(llm, 64, (1, 8))
    assert peaks[1] == 8 * 2 and peaks[8] <= 1.25 * peaks[1]


def test_an_engine_serving_a_hybrid_model_holds_its_full_layers_kv_and_a_window_in_each_sliding_layer(
        make_checkpoint):
    """Gemma 3's pattern, five sliding layers to one full one: at 8x the window, the full layer's blocks and one
    window's in each sliding layer (`tokenfleet bench kv-window`'s hybrid figure), a third of full attention's."""
    from bench.kv_window import hybrid_bound, peak_layer_blocks
    from gpu_worker.engine import LLM

    model = make_checkpoint("gemma3", sliding_window=64, num_hidden_layers=6,
                            layer_types=None)  # 5:1, the default pattern
    llm = LLM(str(model), dtype="float32", block_size=8, enable_prefix_caching=False, kv_cache_memory_bytes=8 << 20)
    assert [llm.engine.model_config.window_of(i) for i in range(6)] == [64] * 5 + [None]
    held = peak_layer_blocks(llm, 64, (8,))[8]
    assert held <= hybrid_bound(llm.engine.model_config, 8 * 64, 8)
    assert held < 6 * 64 / 3, "full attention in every layer: 64 blocks of 8 tokens in each of 6 layers"
