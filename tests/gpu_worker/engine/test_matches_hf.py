"""Greedy output equals HF transformers `generate` token for token (float32), under any batching."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.engine import LLM, SamplingParams
from gpu_worker.engine.model_config import ModelConfig
from tests.conftest import DEVICE, hf_greedy

NUM_PROMPTS = 32
# 8192 blocks of these models: room for every test, where a GPU's default (gpu_memory_utilization 0.9) would
# give each engine millions of blocks to set up.
KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32000) for _ in range(rng.randint(1, 300))] for _ in range(NUM_PROMPTS)]
    return prompts, [rng.randint(1, 32) for _ in prompts]


@pytest.fixture(scope="module", params=["llama", "llama3-rope", "yarn", "llama-tied", "qwen2", "mistral", "qwen3",
                                        "qwen3-moe", "mixtral", "phi3", "phi4-mini", "mistral-sliding",
                                        "qwen2-sliding", "gemma2", "gemma3"])
def reference(request, make_checkpoint, workload):
    model_dir = make_checkpoint(request.param)
    prompts, max_new = workload
    return model_dir, hf_greedy(model_dir, prompts, max_new)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _run(model_dir, workload, count: int, **engine_kwargs):
    prompts, max_new = workload
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE, **{"kv_cache_memory_bytes": KV_BYTES, **engine_kwargs})
    outputs = llm.generate(prompts[:count], [_greedy(n) for n in max_new[:count]])
    return llm, [o.token_ids for o in outputs]


@pytest.mark.parametrize("concurrency", [1, 32])
def test_greedy_equals_hf_at_any_concurrency(reference, workload, concurrency):
    model_dir, expected = reference
    llm, got = _run(model_dir, workload, concurrency)
    assert got == expected[:concurrency]
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_greedy_equals_hf_with_chunked_prefill(reference, workload):
    model_dir, expected = reference
    _, got = _run(model_dir, workload, NUM_PROMPTS, max_num_batched_tokens=32)
    assert got == expected


def test_greedy_equals_hf_under_preemption(reference, workload):
    model_dir, expected = reference
    # Room for 40 blocks of 16 tokens: a few long requests fill it and force recompute preemptions.
    cfg = ModelConfig.from_dir(model_dir)
    block_bytes = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # K+V, block 16, fp32
    llm, got = _run(model_dir, workload, NUM_PROMPTS, kv_cache_memory_bytes=40 * block_bytes,
                    max_model_len=512)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert got == expected
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


@pytest.mark.parametrize("arch", ["gpt-oss", "olmoe"])
def test_greedy_equals_hf_on_a_quarter_of_the_workload(make_checkpoint, workload, arch):
    """Families whose HF reference (eager attention, an expert loop) costs more than the suite has room for over
    the whole workload: its first 8 prompts (all longer than gpt-oss's window), at once, in chunks of 32 tokens
    (prefill over cached context, decode rows of several lengths in one step)."""
    prompts, max_new = (part[:8] for part in workload)
    model_dir = make_checkpoint(arch)
    _, got = _run(model_dir, (prompts, max_new), 8, max_num_batched_tokens=32)
    assert got == hf_greedy(model_dir, prompts, max_new)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3-moe", "gemma3", "olmoe", "gpt-oss"])
def test_bfloat16_top1_within_hf_top5_until_divergence(make_checkpoint, workload, arch):
    """vLLM's check_logprobs_close rule: until the first divergence, ours is in HF's top 5."""
    from transformers import AutoModelForCausalLM

    # heads of 32: the CPU kernels serve them (OLMoE's q/k norms take hidden / heads as the head size: a wider hidden)
    heads_of_32 = {"hidden_size": 128} if arch == "olmoe" else {"head_dim": 32}
    model_dir = make_checkpoint(arch, dtype=torch.bfloat16, **heads_of_32)
    prompts, max_new = workload
    prompts, max_new = prompts[:8], max_new[:8]
    ours = LLM(str(model_dir), dtype="bfloat16", device=DEVICE, kv_cache_memory_bytes=KV_BYTES).generate(
        prompts, [_greedy(n) for n in max_new])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    for prompt, out, n in zip(prompts, ours, max_new, strict=True):
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, output_scores=True, return_dict_in_generate=True,
                              pad_token_id=0)
        hf_tokens = gen.sequences[0, len(prompt):].tolist()
        for pos, (mine, theirs) in enumerate(zip(out.token_ids, hf_tokens, strict=True)):
            if mine != theirs:
                top5 = gen.scores[pos][0].topk(5).indices.tolist()
                assert mine in top5, f"position {pos}: our {mine} not in HF top-5 {top5}"
                break


def test_logprobs_match_hf_log_softmax(make_checkpoint, workload):
    from transformers import AutoModelForCausalLM

    model_dir = make_checkpoint("qwen2")
    prompt = workload[0][3]
    out = LLM(str(model_dir), dtype="float32", device=DEVICE, kv_cache_memory_bytes=KV_BYTES).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5))[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids], device=DEVICE)).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits, dim=-1)
    assert len(out.logprobs) == 8
    for pos, entry in enumerate(out.logprobs):
        assert len(entry) >= 5 and out.token_ids[pos] in entry
        top5 = expected[pos].topk(5).indices.tolist()
        assert set(top5) <= set(entry)
        for token, lp in entry.items():
            assert abs(lp - expected[pos, token].item()) < 1e-4
