"""The engine on the CUDA path's pieces, run on CPU: Triton's paged attention (in Triton's interpreter, fp32) in
every layer, and decode steps through `DecodeGraphs` (buckets, static buffers, the padding block) with each
"graph" a plain call of the forward it would capture. On CUDA, tests/gpu_worker/engine/test_cuda.py runs the real
thing."""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="Triton is not installed")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA, tests/gpu_worker/engine/test_cuda.py runs "
                                "the real kernels and graphs; these run the interpreter's on CPU tensors")

from gpu_worker.engine import LLM, SamplingParams  # noqa: E402
from gpu_worker.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from gpu_worker.engine.kv_cache_manager import cdiv  # noqa: E402
from gpu_worker.engine.triton_attention import TritonPagedAttention  # noqa: E402
from tests.conftest import hf_greedy  # noqa: E402


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 32000) for _ in range(rng.randint(1, 90))] for _ in range(4)]
    return prompts, [rng.randint(1, 8) for _ in prompts]


def _on_triton(llm: LLM) -> LLM:
    for layer in llm.engine.runner.model.layers:
        torch_path = layer.self_attn.attn
        layer.self_attn.attn = TritonPagedAttention(torch_path.heads)
        layer.self_attn.attn.sinks = torch_path.sinks  # as `model.Attention.pack` hands them over
    return llm


def _with_decode_graphs(llm: LLM, max_num_seqs: int) -> Counter:
    """Decode steps through DecodeGraphs over a cache with one padding block more, as the engine builds them on
    CUDA; returns the count of replays by bucket."""
    engine, runner = llm.engine, llm.engine.runner
    cfg, num_blocks, bs, layout = engine.model_config, engine.kv.pool.num_blocks, engine.block_size, engine.kv_layout
    runner.kv_caches = layout.caches_by_layer(engine.kv_format.allocate(
        layout.num_slots, num_blocks + 1, bs, cfg.num_kv_heads, cfg.head_dim, torch.device("cpu")))
    replays = Counter()

    def capture(forward, pool):
        def replay():
            out = forward()
            replays[len(out)] += 1
            return out

        return replay

    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.layer_groups, bs, max_num_seqs,
                                 cdiv(engine.max_model_len, bs) + 1, num_blocks, torch.device("cpu"), capture)
    runner.graphs.capture_all()
    return replays


def _greedy(prompts, max_new, llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_new]
    return [o.token_ids for o in llm.generate(prompts, params)]


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, **kwargs)


def test_greedy_on_triton_attention_equals_hf_with_chunked_prefill(make_checkpoint, workload):
    model_dir = make_checkpoint("llama")
    prompts, max_new = workload
    # A 32-token budget splits the longer prompts into chunks, each attending over the ones cached before it.
    llm = _on_triton(_llm(model_dir, max_num_batched_tokens=32))
    assert _greedy(prompts, max_new, llm) == hf_greedy(model_dir, prompts, max_new)


def test_greedy_on_triton_attention_with_sinks_and_sliding_layers_equals_hf(make_checkpoint, workload):
    """gpt-oss: each head's sink joined to its softmax, and every other layer over a window shorter than most
    prompts, in chunks that attend over the ones cached before them."""
    model_dir = make_checkpoint("gpt-oss")
    longer = [(p, n) for p, n in zip(*workload, strict=True) if len(p) > 40][:2]  # than its window (conftest)
    prompts, max_new = [p for p, _ in longer], [n for _, n in longer]
    assert len(prompts) == 2
    llm = _on_triton(_llm(model_dir, max_num_batched_tokens=32))
    assert _greedy(prompts, max_new, llm) == hf_greedy(model_dir, prompts, max_new)


def test_decode_graphs_pad_each_step_to_its_bucket_and_change_no_token(make_checkpoint):
    model_dir = make_checkpoint("qwen2")
    rng = random.Random(6)
    # All four prompts prefill in the first step; then 4 decode rows, 3 (padded to 4) as one finishes, 2, 1.
    prompts, max_new = [[rng.randrange(1, 32000) for _ in range(n)] for n in (5, 9, 30, 17)], [8, 3, 5, 6]
    llm = _on_triton(_llm(model_dir, max_num_seqs=4))
    replays = _with_decode_graphs(llm, max_num_seqs=4)
    assert _greedy(prompts, max_new, llm) == hf_greedy(model_dir, prompts, max_new)
    assert replays == {4: 4, 2: 1, 1: 2}
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_decode_graphs_of_a_hybrid_model_read_each_groups_tables(make_checkpoint, workload):
    """Gemma 3: a sliding layer (window 40, shorter than these prompts) and a full one, each reading block tables of
    its own group through the graphs' static buffers."""
    model_dir = make_checkpoint("gemma3")
    longer = [(p, n) for p, n in zip(*workload, strict=True) if len(p) > 40][:2]
    prompts, max_new = [p for p, _ in longer], [n + 4 for _, n in longer]
    llm = _on_triton(_llm(model_dir, max_num_seqs=2, block_size=16))
    assert llm.engine.kv_layout.windows == [None, 40]
    replays = _with_decode_graphs(llm, max_num_seqs=2)
    assert _greedy(prompts, max_new, llm) == hf_greedy(model_dir, prompts, max_new)
    assert sum(replays.values()) > 0
