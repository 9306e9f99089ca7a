"""Each engine step's wall time is attributed to the requests in it in proportion to the tokens computed for
each (a prefill chunk's many, a decode's one); the attributions sum to the steps' time (the ledger prices
a task's GPU-seconds from them)."""

from __future__ import annotations

import math
import random

from gpu_worker.engine import EngineConfig, LLMEngine, SamplingParams


def test_requests_time_shares_sum_to_the_engines_busy_time_with_chunked_prefill_and_decodes(make_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(make_checkpoint("llama")), dtype="float32", max_num_batched_tokens=64,
                                    kv_cache_memory_bytes=16 << 20))
    rng = random.Random(3)
    for i in range(6):  # prompts longer than the step budget are prefilled in chunks beside others' decodes
        prompt = [rng.randrange(1, 1000) for _ in range(rng.choice([5, 40, 150]))]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(3, 12),
                                                           ignore_eos=True))
    totals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            totals[out.request_id] = out.engine_seconds
    assert len(totals) == 6 and all(seconds > 0 for seconds in totals.values())
    assert math.isclose(sum(totals.values()), engine.stats()["busy_seconds"], rel_tol=1e-9)


def test_two_prefills_in_one_step_share_it_by_their_token_counts(make_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(make_checkpoint("llama")), dtype="float32",
                                    kv_cache_memory_bytes=16 << 20))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # done in the one prefill step
    engine.add_request("short", [5] * 4, params)
    engine.add_request("long", [7] * 400, params)
    totals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            totals[out.request_id] = out.engine_seconds
    assert math.isclose(totals["long"] / totals["short"], 100.0)
