"""The Batch API's completion window, shortened to seconds (TOKENFLEET_GATEWAY_BATCH_COMPLETION_WINDOW_S): the
real gateway app and batch job on a real Redis, without the model stack: the job's `_generate` (what the stack
answers) is replaced, and no Celery worker runs unless a test runs the job itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import httpx
import openai
import pytest

from gateway.app import create_app
from services.base import protocol as p
from services.base.redis_client import connect
from services.base.settings import GatewaySettings, RouterSettings, StreamSettings
from services.batch.runner import BatchJob
from services.batch.store import EXPIRY_TAKEOVER_S, line_request_id
from services.tenancy.auth import register_key

from .test_batches import _chat, _jsonl

WINDOW_S = 2
LINES = [f"line-{i}" for i in range(6)]


@pytest.fixture(autouse=True)
def short_window(monkeypatch):
    monkeypatch.setenv("TOKENFLEET_GATEWAY_BATCH_COMPLETION_WINDOW_S", str(WINDOW_S))


@contextlib.asynccontextmanager
async def gateway(redis_url: str):
    """(Redis, an `openai` client of a new tenant) on the gateway's app, which queues batches to no job."""
    redis = connect(redis_url)
    app = create_app(redis, GatewaySettings(), RouterSettings(), StreamSettings())
    key = await register_key(redis, f"expiry-{uuid.uuid4().hex[:8]}")
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key, max_retries=0, http_client=httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gateway"))
    try:
        yield redis, client
    finally:
        await client.close()
        await redis.aclose()


async def _create(client: openai.AsyncOpenAI):
    file = await client.files.create(file=("batch.jsonl", _jsonl({c: _chat(i) for i, c in enumerate(LINES)})),
                                     purpose="batch")
    return await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")


async def _lines(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in (await client.files.content(file_id)).text.splitlines()] if file_id else []


def _expired_lines(errors: list[dict]) -> list[str]:
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in errors), errors
    return [e["custom_id"] for e in errors]


class TwoLinesAnswered(BatchJob):
    """The stack answers line-0 and line-1 at once and is still running any other line at the deadline."""

    async def _generate(self, key: dict, line, rid: str) -> dict:
        if line.custom_id in ("line-0", "line-1"):
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "choices": []}
        await asyncio.Event().wait()


def test_a_batch_created_expires_its_window_after_its_creation(redis_url):
    async def main():
        async with gateway(redis_url) as (_, client):
            batch = await _create(client)
            return batch, await client.batches.retrieve(batch.id)

    created, read = asyncio.run(main())
    assert created.completion_window == "24h" and created.expires_at == created.created_at + WINDOW_S
    assert (read.expires_at, read.status, read.expired_at) == (created.expires_at, "validating", None)


def test_a_batch_not_finished_in_its_window_expires_keeping_its_answers_and_stopping_the_rest(redis_url):
    async def main():
        async with gateway(redis_url) as (redis, client):
            batch = await _create(client)
            counts = await TwoLinesAnswered(redis, batch.id, max_in_flight=2).run()
            ended = time.time()
            batch = await client.batches.retrieve(batch.id)
            cancelled = {c: await redis.exists(p.cancel_key(line_request_id(batch.id, c))) for c in LINES[2:]}
            return (batch, counts, ended, cancelled, await _lines(client, batch.output_file_id),
                    await _lines(client, batch.error_file_id))

    batch, counts, ended, cancelled, output, errors = asyncio.run(main())
    assert batch.status == "expired" and batch.expires_at <= batch.expired_at <= batch.expires_at + 1
    assert ended - batch.expires_at < 1.0  # the job stopped at the deadline, not when its lines would have ended
    assert counts == {"total": 6, "completed": 2, "failed": 4}
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 4)
    assert [line["custom_id"] for line in output] == ["line-0", "line-1"]
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert _expired_lines(errors) == LINES[2:]  # in input order
    # the two in flight were cancelled in the stack; the two never started were never sent
    assert cancelled == {"line-2": 1, "line-3": 1, "line-4": 0, "line-5": 0}


def test_a_batch_past_its_window_with_no_job_running_expires_when_read(redis_url):
    async def main():
        async with gateway(redis_url) as (_, client):
            batch = await _create(client)  # never run: no Celery worker
            await asyncio.sleep(batch.expires_at - time.time() + 0.05)
            listed = next(b for b in (await client.batches.list()).data if b.id == batch.id)
            batch = await client.batches.retrieve(batch.id)
            return listed, batch, await _lines(client, batch.error_file_id)

    listed, batch, errors = asyncio.run(main())
    assert listed.status == batch.status == "expired" and batch.expired_at >= batch.expires_at
    assert batch.output_file_id is None and (batch.request_counts.completed, batch.request_counts.failed) == (0, 6)
    assert _expired_lines(errors) == LINES


def test_an_expiry_whose_writer_died_is_finished_by_the_next_read(redis_url):
    async def main():
        async with gateway(redis_url) as (redis, client):
            batch = await _create(client)
            # as an expirer that died leaves it: results frozen ("finalizing", expired_at), no files written
            then = int(time.time()) - EXPIRY_TAKEOVER_S - 1
            await redis.hset(p.batch_key(batch.id), mapping={
                "status": json.dumps("finalizing"), "expires_at": json.dumps(then), "expired_at": json.dumps(then),
                "finalizing_at": json.dumps(then)})
            batch = await client.batches.retrieve(batch.id)
            return batch, await _lines(client, batch.error_file_id)

    batch, errors = asyncio.run(main())
    assert batch.status == "expired" and batch.request_counts.failed == 6
    assert _expired_lines(errors) == LINES
