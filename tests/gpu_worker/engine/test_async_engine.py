"""The asyncio wrapper streams deltas as they are produced and aborts what its caller abandons."""

from __future__ import annotations

import asyncio

import pytest

from gpu_worker.engine import (
    LLM,
    AsyncLLMEngine,
    EngineConfig,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
)

PROMPTS = [[3, 14, 15, 92, 65], [2, 71, 82], [1, 41, 42, 13, 56, 23, 73], [16, 18]]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return str(make_checkpoint("llama"))


async def _collect(engine: AsyncLLMEngine, request_id: str, prompt, params) -> tuple[list[int], str, int]:
    tokens, text, deltas = [], "", 0
    async for out in engine.generate(request_id, prompt, params):
        deltas += 1
        tokens += out.outputs[0].token_ids
        text += out.outputs[0].text
    return tokens, text, deltas


def test_concurrent_streams_equal_offline_generation(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = LLM(model_dir, dtype="float32").generate(PROMPTS, params)

    async def main():
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model_dir, dtype="float32")))
        results = await asyncio.gather(*(_collect(engine, f"r{i}", p, params) for i, p in enumerate(PROMPTS)))
        await engine.shutdown()
        return results

    for (tokens, text, deltas), want in zip(asyncio.run(main()), expected, strict=True):
        assert tokens == want.token_ids and text == want.text
        assert deltas == 10  # one delta per generated token


def test_leaving_the_stream_aborts_and_frees_blocks(model_dir):
    async def main():
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model_dir, dtype="float32")))
        stream = engine.generate("long", PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(50):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        pool = engine.engine.kv.pool
        await engine.shutdown()
        return engine.engine.has_unfinished_requests(), pool.num_free == pool.num_blocks

    assert asyncio.run(main()) == (False, True)


def test_bad_request_raises_to_its_caller_only(model_dir):
    async def main():
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model_dir, dtype="float32")))
        good = asyncio.create_task(_collect(engine, "ok", PROMPTS[1], SamplingParams(max_tokens=5)))
        with pytest.raises(InvalidRequestError):
            await _collect(engine, "bad", [], SamplingParams())
        tokens, _, _ = await good
        await engine.shutdown()
        return tokens

    assert len(asyncio.run(main())) <= 5


def test_reusing_a_running_request_id_is_refused_and_the_first_stream_completes(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def main():
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model_dir, dtype="float32")))
        first = asyncio.create_task(_collect(engine, "same", PROMPTS[0], params))
        await asyncio.sleep(0)  # let the first stream register
        with pytest.raises(InvalidRequestError, match="already in use"):
            await _collect(engine, "same", PROMPTS[1], params)
        tokens, _, _ = await asyncio.wait_for(first, timeout=60)
        await engine.shutdown()
        return tokens

    assert len(asyncio.run(main())) == 6


def test_a_request_left_and_started_again_under_its_id_runs_afresh(model_dir):
    """A worker that lost Redis mid-request resumes it under the same id at once: the old run is gone by
    then, and outputs of a step the old one was in never reach the new stream."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = LLM(model_dir, dtype="float32").generate([PROMPTS[0]], params)[0].token_ids

    async def main():
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model_dir, dtype="float32")))
        stream = engine.generate("again", PROMPTS[0], params)
        await anext(stream)
        await stream.aclose()  # queued abort; a step may still be running with the old request in it
        tokens, _, _ = await _collect(engine, "again", PROMPTS[0], params)
        await engine.shutdown()
        return tokens

    assert asyncio.run(main()) == expected
