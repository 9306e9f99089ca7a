"""The engine on CUDA: Triton kernels in every layer, CUDA graphs for decode steps, one host sync per step, the KV
pool sized after a profiled step. Runs wherever torch sees a GPU (bench/gpu_check.sh runs it on one); skipped
elsewhere, where tests/gpu_worker/engine/test_triton_*.py check the same kernels and graph runner in Triton's
interpreter."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from gpu_worker.engine import LLM, SamplingParams
from gpu_worker.engine.cuda_graphs import DecodeGraphs, NoDecodeGraphs
from gpu_worker.engine.triton_attention import TritonPagedAttention
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL_KV = 64 << 20


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 32000) for _ in range(rng.randint(1, 300))] for _ in range(24)]
    return prompts, [rng.randint(1, 48) for _ in prompts]


def _greedy(llm: LLM, prompts, max_new) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_new]
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_cuda_serving_takes_the_paged_kernels_and_captures_decode_graphs(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama")), dtype="bfloat16", device="cuda", kv_cache_memory_bytes=SMALL_KV,
              max_num_seqs=16)
    assert all(isinstance(layer.self_attn.attn, TritonPagedAttention) for layer in llm.engine.runner.model.layers)
    graphs = llm.engine.runner.graphs
    assert isinstance(graphs, DecodeGraphs) and sorted(graphs.replays) == [1, 2, 4, 8, 16]
    eager = LLM(str(make_checkpoint("llama")), dtype="bfloat16", device="cuda", kv_cache_memory_bytes=SMALL_KV,
                enforce_eager=True)
    assert isinstance(eager.engine.runner.graphs, NoDecodeGraphs)


@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-tied", "gemma3"])  # gemma3: a KV-cache group per window
def test_float32_greedy_on_cuda_equals_hf(make_checkpoint, workload, arch, enforce_eager):
    model_dir = make_checkpoint(arch)
    prompts, max_new = workload
    llm = LLM(str(model_dir), dtype="float32", device="cuda", kv_cache_memory_bytes=SMALL_KV,
              max_num_batched_tokens=256, enforce_eager=enforce_eager)
    assert _greedy(llm, prompts, max_new) == hf_greedy(model_dir, prompts, max_new)


def test_cuda_graphs_on_and_off_give_identical_bfloat16_output(make_checkpoint, workload):
    model_dir = make_checkpoint("llama", dtype=torch.bfloat16)
    prompts, max_new = workload
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate(max_new)]
    outputs = []
    for enforce_eager in (False, True):
        llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", kv_cache_memory_bytes=SMALL_KV,
                  enforce_eager=enforce_eager)
        outputs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_preemption_and_prefix_caching_on_cuda_change_no_token(make_checkpoint, workload):
    model_dir = make_checkpoint("llama")
    prompts, max_new = workload
    shared = prompts[0][:64]
    prompts = [shared + p for p in prompts[1:]]  # a common prefix: cached once, hit by every later prompt
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, block 16, 2 KV heads, head dim 16, fp32
    llm = LLM(str(model_dir), dtype="float32", device="cuda", kv_cache_memory_bytes=48 * block_bytes,
              max_model_len=512)
    assert _greedy(llm, prompts, max_new[1:]) == hf_greedy(model_dir, prompts, max_new[1:])
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


def test_a_decode_step_waits_for_the_gpu_once(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama")), dtype="bfloat16", device="cuda", kv_cache_memory_bytes=SMALL_KV)
    engine = llm.engine
    for i in range(8):
        engine.add_request(str(i), [1 + i] * (5 + i), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()  # the prefill
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(5):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 5, [str(w.message) for w in syncs]


def test_the_kv_pool_leaves_room_for_a_full_step_at_90_percent(make_checkpoint):
    """gpu_memory_utilization 0.9 with no KV budget given: the pool is sized after a profiled step, so the largest
    step the scheduler makes (a full token budget of prefill, then max_num_seqs rows sampled) does not run out."""
    model_dir = make_checkpoint("llama", dtype=torch.bfloat16)
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", max_num_batched_tokens=4096, max_num_seqs=128,
              max_model_len=1024)
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 32000) for _ in range(1000)] for _ in range(128)]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 16 for o in outputs)
    free, total = torch.cuda.mem_get_info()
    assert total - free <= 0.92 * total
