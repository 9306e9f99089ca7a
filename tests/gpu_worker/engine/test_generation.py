"""Sampling, stopping, n > 1 and the pool's bookkeeping, through the public `LLM` API."""

from __future__ import annotations

import random

import pytest

from gpu_worker.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    return LLM(str(make_checkpoint("llama")), dtype="float32")


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 32000) for _ in range(rng.randint(1, 200))] for _ in range(count)]


def _assert_pool_free(llm: LLM) -> None:
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_blocks, "KV blocks leaked"


def test_seeded_sampling_is_the_same_alone_and_inside_a_mixed_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = _prompts(1, seed=7)[0]
    alone = llm.generate(prompt, params)[0].token_ids
    others = _prompts(15, seed=8)
    mixed = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True)
             for t, m in zip([0.0, 0.7, 1.3] * 5, range(5, 20), strict=True)]
    batch = llm.generate(others[:7] + [prompt] + others[7:], mixed[:7] + [params] + mixed[7:])
    assert batch[7].token_ids == alone
    _assert_pool_free(llm)


def test_sampling_without_seed_varies(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = {tuple(llm.generate(_prompts(1)[0], params)[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_max_tokens_bounds_the_output_and_reports_length(llm):
    out = llm.generate(_prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ids_end_generation_at_that_token(llm):
    prompt = _prompts(1)[0]
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0].token_ids
    stop_at = free[3]
    first = free.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_stop_string_is_cut_from_the_text(llm):
    prompt = _prompts(1, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate(prompt, params)[0].text
    stop = full[10:13]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_n_samples_share_the_prompt_blocks(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama")), dtype="float32", block_size=16)
    prompt = _prompts(1, seed=4)[0][:1] * 100  # 100 tokens: 6 full blocks of 16 shared, 1 partial each
    engine = llm.engine
    engine.add_request("fork", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=4,
                                                      ignore_eos=True))
    engine.step()  # sample 0 prefills the prompt; the other three fork from it
    tables = [engine.kv.tables[s.seq_id][0] for s in engine.requests["fork"].seqs]
    assert all(t[:6] == tables[0][:6] for t in tables)
    engine.step()  # each fork computes its own prompt tail into one block of its own
    assert engine.kv.pool.num_used == 7 + 3 * 1  # unshared it would be 4 * 7
    while engine.has_unfinished_requests():
        engine.step()
    _assert_pool_free(llm)


def test_n_seeded_samples_differ_and_greedy_samples_agree(llm):
    prompt = _prompts(1, seed=5)[0]
    sampled = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) == 3
    greedy = llm.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    single = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert all(c.token_ids == single.token_ids for c in greedy.outputs)
    _assert_pool_free(llm)


def test_eos_ends_generation_unless_ignored(llm):
    prompt = _prompts(1, seed=6)[0]
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0].token_ids
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset([free[2]])  # declare an early token the model's EOS
    try:
        stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20))[0]
        ignored = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    finally:
        engine.eos_token_ids = saved
    assert stopped.token_ids == free[: free.index(free[2]) + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == free


def test_waste_stays_below_one_block_per_running_sequence(llm):
    engine = llm.engine
    for i, prompt in enumerate(_prompts(12, seed=11)):
        engine.add_request(f"w{i}", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        assert engine.kv.partial_block_waste(running) < engine.kv.block_size * max(1, len(running))
        for seq in running:
            assert engine.kv.partial_block_waste([seq]) < engine.kv.block_size
    _assert_pool_free(llm)


def test_outputs_come_back_in_input_order(llm):
    prompts = _prompts(6, seed=12)
    lengths = [9, 1, 5, 3, 7, 2]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    assert [len(o.token_ids) for o in outs] == lengths
    assert [o.prompt_token_ids for o in outs] == prompts


def test_a_seeded_request_run_alone_gives_the_same_tokens_every_time_in_bf16(make_checkpoint):
    """What docs/engine.md promises without `deterministic=True`: the same request alone, run after run (bf16, the
    CPU serving dtype, whose kernels differ with the batch's size but not from one run to the next)."""
    import torch

    llm = LLM(str(make_checkpoint("llama", dtype=torch.bfloat16)), dtype="bfloat16")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    prompt = _prompts(1, seed=11)[0]
    runs = [llm.generate(prompt, params)[0].token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 24


def test_the_offline_class_steps_up_to_vllms_cpu_default_unless_told(make_checkpoint):
    model = str(make_checkpoint("llama"))
    assert LLM(model, dtype="float32").engine.scheduler.config.max_num_batched_tokens == 4096
    assert LLM(model, dtype="float32", max_num_batched_tokens=64).engine.scheduler.config.max_num_batched_tokens == 64
