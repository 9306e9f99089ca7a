"""Attention sinks (gpt-oss: a learned logit per head joined to its softmax, taking probability mass and adding no
value) in the native CPU kernels, against the reference (`TorchPagedAttention` / `ScaledPagedAttention`
with the same sink logits): bf16 and int8 caches, with and without a sliding window, through the decode kernel
alone, the decode step in one call and the prefill kernel. Sinks of a few units, large enough that ignoring them
fails each case."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine.attention import HeadLayout, ScaledPagedAttention, TorchPagedAttention
from gpu_worker.engine.cpu_attention import CpuInt8PagedAttention, CpuPagedAttention, NativePrefillAttention
from gpu_worker.engine.kernels import cpu_kernels
from gpu_worker.engine.kv_cache_format import ScaledKVCache, quantize_per_row
from gpu_worker.engine.rope import RotaryEmbedding
from tests.gpu_worker.engine.test_sliding_window_kernels import close_in_bf16, needs_native_prefill, prefill_case
from tests.kernel_inputs import NATIVE_BUILDS, decode_metadata, free_out_of_window

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
CONTEXTS = [1, 17, 300, 64, 5, 129]


def _with_sinks(attention, sinks: torch.Tensor):
    attention.sinks = sinks  # as `model.Attention.pack` hands them over
    return attention


def _case(window: int | None, seed: int):
    torch.manual_seed(seed)
    num_blocks = sum(-(-c // BLOCK_SIZE) for c in CONTEXTS) + 2
    cache = torch.randn(2, num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM).bfloat16()
    meta = decode_metadata(CONTEXTS, num_blocks, BLOCK_SIZE)
    if window is not None:
        free_out_of_window(meta, window)
    layout = HeadLayout(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, window, sinks=True)
    sinks = torch.empty(HEADS).uniform_(-1.0, 4.0)
    return cache, meta, layout, sinks


def _assert_sinks_matter(got: torch.Tensor, want: torch.Tensor, without: torch.Tensor) -> None:
    assert close_in_bf16(got, want), f"max error {(got.float() - want.float()).abs().max().item():.3g}"
    assert not close_in_bf16(without, want), "the sinks change nothing here: the case tests nothing"


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
@pytest.mark.parametrize("window", [None, 37])
def test_native_bf16_decode_joins_each_heads_sink_to_its_softmax(kernels, window):
    cache, meta, layout, sinks = _case(window, seed=1)
    q = torch.randn(len(CONTEXTS), HEADS, HEAD_DIM).bfloat16()
    want = _with_sinks(TorchPagedAttention(layout), sinks).decode(q.float(), cache.float(), meta)
    got = _with_sinks(CpuPagedAttention(layout, kernels()), sinks).decode(q, cache, meta)
    without = CpuPagedAttention(HeadLayout(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, window), kernels()).decode(
        q, cache, meta)
    _assert_sinks_matter(got, want, without)


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
def test_native_int8_decode_joins_each_heads_sink_to_its_softmax(kernels):
    cache, meta, layout, sinks = _case(None, seed=2)
    data, scale = quantize_per_row(cache)
    q = torch.randn(len(CONTEXTS), HEADS, HEAD_DIM).bfloat16()
    want = _with_sinks(ScaledPagedAttention(layout), sinks).decode(q.float(), ScaledKVCache(data, scale.float()), meta)
    got = _with_sinks(CpuInt8PagedAttention(layout, kernels()), sinks).decode(q, ScaledKVCache(data, scale), meta)
    without = CpuInt8PagedAttention(HeadLayout(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5), kernels()).decode(
        q, ScaledKVCache(data, scale), meta)
    _assert_sinks_matter(got, want, without)


@pytest.mark.parametrize("kernels", NATIVE_BUILDS)
def test_a_native_decode_step_in_one_call_joins_the_sinks(kernels):
    cache, meta, layout, sinks = _case(None, seed=3)
    qkv = torch.randn(len(CONTEXTS), (HEADS + 2 * KV_HEADS) * HEAD_DIM).bfloat16()
    cos, sin = RotaryEmbedding(HEAD_DIM, 10000.0, {}).cos_sin(meta.decode_context_lens - 1, torch.bfloat16)
    want = _with_sinks(TorchPagedAttention(layout), sinks)(qkv.clone(), cos, sin, cache.clone(), meta)
    got = _with_sinks(CpuPagedAttention(layout, kernels()), sinks)(qkv.clone(), cos, sin, cache.clone(), meta)
    without = CpuPagedAttention(HeadLayout(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5), kernels())(
        qkv.clone(), cos, sin, cache.clone(), meta)
    _assert_sinks_matter(got, want, without)


@needs_native_prefill
@pytest.mark.parametrize("window", [None, 37])
def test_native_prefill_joins_each_heads_sink_to_its_softmax(window):
    torch.manual_seed(5)
    q, k, v, cache, meta, full_meta = prefill_case(window or 100_000, BLOCK_SIZE, KV_HEADS, HEAD_DIM, HEADS)
    if window is None:
        meta = full_meta
    layout = HeadLayout(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, window, sinks=True)
    sinks = torch.empty(HEADS).uniform_(-1.0, 4.0)
    rows = slice(meta.num_decodes, None)  # the prefill chunks' rows
    want = _with_sinks(TorchPagedAttention(layout), sinks).attend(q.float(), k.float(), v.float(), cache.float(), meta)
    got = _with_sinks(NativePrefillAttention(layout, cpu_kernels()), sinks).attend(q, k, v, cache, meta)
    without = NativePrefillAttention(HeadLayout(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, window),
                                     cpu_kernels()).attend(q, k, v, cache, meta)
    _assert_sinks_matter(got[rows], want[rows], without[rows])
