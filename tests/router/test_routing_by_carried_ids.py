"""The router reads a prompt's ids from the request when an earlier hop tokenized it, though it holds the
tokenizer too: the prefix directory is asked about the carried ids' blocks and the tier rule counts them. A
request that carries none is tokenized here, once, and forwarded with its ids for the worker."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from cache.prefix_directory import PrefixDirectory
from cache.response_cache import ResponseCache
from router.policy import TierPolicy, TierRule
from router.service import Router
from router.worker_choice import WorkerChooser
from services.base import protocol as p
from services.base.redis_client import EmbeddedRedis, connect
from services.base.settings import CacheSettings, StreamSettings
from services.text.block_hash import block_hashes
from services.text.tokenizer_files import open_tokenizer

BLOCK = 16
TEXT = "The quick brown fox jumps over the lazy dog, again and again, " * 6


@pytest.fixture
def fresh_redis_url():
    embedded = EmbeddedRedis()
    yield embedded.url
    embedded.close()


def _request(model: str, carried: tuple[str, str, list[int]] | None = None) -> p.GenerateRequest:
    """`carried`: (served model, tokenizer fingerprint, ids) an earlier hop attached."""
    request = p.GenerateRequest(request_id=uuid.uuid4().hex, kind="completion", model=model, prompt=TEXT,
                                sampling=p.SamplingOptions(max_tokens=2))
    if carried:
        name, fingerprint, ids = carried
        request.prompt_token_ids = p.PromptTokenIds(ids={fingerprint: ids}, tokenizers={name: fingerprint})
    return request


async def _serve(redis, model: str, model_dir: str, workers: list[str]) -> None:
    """`model` registered with live workers, as their heartbeats leave it."""
    info = p.ModelInfo(name=model, model_dir=model_dir, max_model_len=1024, kv_block_size=BLOCK)
    await redis.hset(p.MODELS_KEY, model, info.model_dump_json())
    for worker in workers:
        status = p.WorkerStatus(worker_id=worker, model=model, running=0, waiting=0, kv_blocks_used=0,
                                kv_blocks_total=100, updated_at=time.time())
        await redis.set(p.heartbeat_key(model, worker), status.model_dump_json())
        await redis.zadd(p.workers_key(model), {worker: time.time() + 60})


async def _routed(redis, rule: TierRule, requests: list[p.GenerateRequest],
                  inboxes: list[str]) -> dict[str, p.GenerateRequest]:
    """request id -> the request as forwarded, once every one of them is in one of `inboxes`."""
    router = Router(redis, TierPolicy(rule), WorkerChooser(BLOCK, 1), ResponseCache(redis, CacheSettings()),
                    "router-a", StreamSettings())
    for request in requests:
        await redis.xadd(p.REQUESTS_STREAM, request.encode())
    stop = asyncio.Event()
    running = asyncio.create_task(router.run(stop))
    deadline = time.monotonic() + 60
    forwarded: dict[str, p.GenerateRequest] = {}
    while len(forwarded) < len(requests):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)
        forwarded = {r.request_id: r for inbox in inboxes
                     for r in (p.decode(p.GenerateRequest, f) for _, f in await redis.xrange(inbox))}
    stop.set()
    await running
    return forwarded


def _run(scenario):
    """`asyncio.run(scenario())`, except that tasks still pending at its end get 10 s to end once cancelled, not
    for ever: a router task that outlives its scenario fails the test instead of hanging the suite."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(scenario())
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=10))
        loop.close()


def test_the_prefix_directory_is_asked_about_the_carried_ids_blocks_not_the_texts(fresh_redis_url,
                                                                                  make_checkpoint):
    model_dir = str(make_checkpoint("llama"))
    tokenizer = open_tokenizer(model_dir)
    text_ids, carried_ids = tokenizer.encode(TEXT), list(range(100, 100 + 4 * BLOCK))
    assert text_ids[:BLOCK] != carried_ids[:BLOCK]
    carried = _request("m", ("m", tokenizer.fingerprint, carried_ids))
    plain = _request("m")

    async def scenario():
        redis = connect(fresh_redis_url)
        await _serve(redis, "m", model_dir, ["holds-text", "holds-ids"])
        directory = PrefixDirectory(redis, "m")
        await directory.apply("holds-text", [(True, h) for h in block_hashes(text_ids, BLOCK)], None)
        await directory.apply("holds-ids", [(True, h) for h in block_hashes(carried_ids, BLOCK)], None)
        forwarded = await _routed(redis, TierRule("s", "l", 10, 10), [carried, plain],
                                  [p.inbox_stream("m", w) for w in ("holds-text", "holds-ids")])
        await redis.aclose()
        return forwarded

    forwarded = _run(scenario)
    via_ids, via_text = forwarded[carried.request_id], forwarded[plain.request_id]
    assert (via_ids.routing.worker, via_ids.routing.prefix_tokens) == ("holds-ids", len(carried_ids))
    assert via_ids.prompt_token_ids == carried.prompt_token_ids  # forwarded as it came
    assert via_text.routing.worker == "holds-text"
    assert via_text.routing.prefix_tokens == len(text_ids) // BLOCK * BLOCK
    assert via_text.prompt_token_ids == p.PromptTokenIds(ids={tokenizer.fingerprint: text_ids},
                                                         tokenizers={"m": tokenizer.fingerprint})


def test_the_tier_rule_counts_the_carried_ids(fresh_redis_url, make_checkpoint):
    """The text is a couple of hundred tokens, the carried ids ten: under the rule's limit of 64, it stays small."""
    model_dir = str(make_checkpoint("llama"))
    tokenizer = open_tokenizer(model_dir)
    assert len(tokenizer.encode(TEXT)) > 64
    request = _request(p.AUTO_MODEL, ("small", tokenizer.fingerprint, list(range(100, 110))))

    async def scenario():
        redis = connect(fresh_redis_url)
        for tier in ("small", "large"):
            await _serve(redis, tier, model_dir, [f"{tier}-worker"])
        forwarded = await _routed(redis, TierRule("small", "large", 64, 16), [request],
                                  [p.inbox_stream(t, f"{t}-worker") for t in ("small", "large")])
        await redis.aclose()
        return forwarded[request.request_id]

    routed = _run(scenario)
    assert routed.routing.model == "small" and routed.routing.reason.startswith("auto: prompt 10 <= 64 tokens")
