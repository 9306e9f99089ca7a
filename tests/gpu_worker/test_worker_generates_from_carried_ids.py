"""A worker serves the prompt ids a request carries for its own tokenizer and does not tokenize the prompt again;
ids an earlier hop made with another tokenizer it does not trust, and tokenizes the prompt itself."""

from __future__ import annotations

import asyncio
import uuid

from cache.response_cache import ResponseCache
from gpu_worker.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.service import Worker
from services.base import protocol as p
from services.base import replies
from services.base.redis_client import connect
from services.base.settings import CacheSettings, StreamSettings, WorkerSettings
from services.text.tokenizer_files import open_tokenizer

TEXT = "hello there, how are you"


def _request(prompt: str | list[int], carried: dict[str, list[int]] | None = None) -> p.GenerateRequest:
    """`carried`: tokenizer fingerprint -> the ids an earlier hop attached."""
    request = p.GenerateRequest(request_id=uuid.uuid4().hex, kind="completion", model="m", prompt=prompt,
                                sampling=p.SamplingOptions(max_tokens=4, temperature=0.0))
    if carried:
        request.prompt_token_ids = p.PromptTokenIds(ids=carried, tokenizers={"m": next(iter(carried))})
    return request


def _served(redis_url: str, engine: LLMEngine, requests: list[p.GenerateRequest]) -> list[list[p.ReplyChunk]]:
    """Each request's reply stream, the requests served by a worker of `engine` on its own model's stream."""
    name = f"carried-{uuid.uuid4().hex[:8]}"

    async def scenario():
        redis = connect(redis_url)
        info = p.ModelInfo(name=name, model_dir=str(engine.model_path), max_model_len=engine.max_model_len,
                           kv_block_size=engine.block_size)
        worker = Worker(redis, AsyncLLMEngine(engine), info, f"{name}-worker", WorkerSettings(metrics_port=-1),
                        StreamSettings(), ResponseCache(redis, CacheSettings()), WorkerMetrics(engine, name))
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            for request in requests:
                await redis.xadd(p.work_stream(name), request.encode())
            return [[chunk async for chunk in replies.follow_replies(redis, r.request_id, 60)] for r in requests]
        finally:
            stop.set()
            await running
            await redis.aclose()

    return asyncio.run(scenario())


def test_a_worker_generates_from_the_carried_ids_and_tokenizes_only_when_none_are_its_tokenizers(
        redis_url, make_checkpoint):
    model_dir = str(make_checkpoint("llama"))
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", kv_cache_memory_bytes=16 << 20))
    ids = list(range(40, 60))  # not what the text tokenizes to
    assert engine.tokenizer.encode(TEXT) != ids
    gateways = open_tokenizer(model_dir)  # the key a gateway or router attaches the ids under
    carried, as_ids, foreign = (_request(TEXT, {gateways.fingerprint: ids}), _request(ids),
                                _request(TEXT, {"another-tokenizer": ids}))

    replied = _served(redis_url, engine, [carried, as_ids, foreign])

    finished = [chunks[-1] for chunks in replied]
    assert [c.kind for c in finished] == ["finished"] * 3
    assert [c.usage.prompt_tokens for c in finished] == [len(ids), len(ids), len(engine.tokenizer.encode(TEXT))]

    def tokens(chunks: list[p.ReplyChunk]) -> list[int]:
        return [t for c in chunks if c.kind == "delta" for t in c.token_ids]

    assert tokens(replied[0]) == tokens(replied[1])  # the carried ids, as a prompt of ids would be served
