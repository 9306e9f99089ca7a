"""The Batch API end to end: files and batches through the real `openai` client, the lines run by a real Celery
worker (the batch job) through the real stack, interactive requests served meanwhile within their SLA."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from gpu_worker.service import Worker
from services.base import protocol as p
from services.base.redis_client import connect
from services.batch.runner import run_batch
from services.tenancy.auth import hash_key, register_key
from services.tenancy.prices import PriceTable
from tests.stack import API_KEY, MODEL

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
from services.jobs.tasks import run_worker
from services.base.settings import AccountingSettings
raise SystemExit(run_worker(AccountingSettings(), {redis_url!r}, beat=False, loglevel="WARNING"))
"""


@pytest.fixture(scope="module")
def batch_worker(stack, tmp_path_factory):
    """A Celery worker on the stack's Redis, with the default key prefix the gateway sends with."""
    log = tmp_path_factory.mktemp("celery") / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen([sys.executable, "-c", WORKER.format(redis_url=stack.redis_url)], cwd=ROOT,
                                  env=stack.env, stdout=out, stderr=subprocess.STDOUT)
    yield log
    worker.terminate()
    try:
        worker.wait(20)
    except subprocess.TimeoutExpired:
        worker.kill()


def _jsonl(bodies: dict[str, dict], url: str = "/v1/chat/completions") -> bytes:
    return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n"
                   for cid, body in bodies.items()).encode()


def _chat(i: int, max_tokens: int = 12, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
            "max_tokens": max_tokens, "temperature": 0, **extra}


def _submit(client: openai.OpenAI, bodies: dict[str, dict]):
    file = client.files.create(file=("batch.jsonl", _jsonl(bodies)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")


def _wait(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float, log: Path):
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, f"batch {batch.status}: {log.read_text()[-3000:]}"
        time.sleep(0.1)
    return batch


def _ttft(client: openai.OpenAI, i: int) -> float:
    started = time.perf_counter()
    stream = client.chat.completions.create(**_chat(1000 + i, max_tokens=4), stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - started
            break
    else:
        ttft = time.perf_counter() - started
    stream.close()
    return ttft


def test_a_batch_completes_with_every_line_while_interactive_requests_keep_their_sla(stack, batch_worker):
    client = stack.client()
    idle = [_ttft(client, i) for i in range(2)]  # the first request of a fresh stack pays one-time warm-ups
    bodies = {f"line-{i}": _chat(i) for i in range(50)}
    batch = _submit(client, bodies)
    assert batch.object == "batch" and batch.status in ("validating", "in_progress")
    assert batch.request_counts.total == 50
    _wait(client, batch.id, {"in_progress", "completed"}, 20, batch_worker)
    ttfts = [_ttft(client, i) for i in range(4)]  # while the batch keeps 8 lines in the stack
    running = client.batches.retrieve(batch.id)
    batch = _wait(client, batch.id, {"completed", "failed", "cancelled"}, 60, batch_worker)
    assert running.status == "in_progress", "the interactive requests were not measured during the batch"
    assert max(ttfts) < 1.0, (ttfts, idle)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (50, 0)
    assert batch.completed_at and batch.in_progress_at and batch.output_file_id
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in lines] == list(bodies)  # all of them, in input order
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in lines)
    for line in (lines[0], lines[37]):  # greedy: the same text as the request sent interactively
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] > 0
        interactive = client.chat.completions.create(**bodies[line["custom_id"]])
        assert body["choices"][0]["message"]["content"] == interactive.choices[0].message.content
    event = stack.completion_event(lines[5]["response"]["body"]["id"])
    assert event.sla_class == "batch" and event.api_key_name == "dev"


def test_a_malformed_line_is_refused_naming_it(stack):
    lines = _jsonl({"a": _chat(1), "b": _chat(2)}) + b'{"custom_id": "c", "method": "POST", "url": "/v1/chat/' \
        b'completions", "body": {"model": "x", "messages": [], "max_tokens": 3}}\n'
    with pytest.raises(openai.BadRequestError, match="line 3") as refused:
        stack.client().files.create(file=("bad.jsonl", lines), purpose="batch")
    assert refused.value.body["param"] == "line 3"
    duplicate = _jsonl({"a": _chat(1)}) * 2
    with pytest.raises(openai.BadRequestError, match="line 2: duplicate custom_id"):
        stack.client().files.create(file=("dup.jsonl", duplicate), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 1: 'url'"):
        stack.client().files.create(file=("url.jsonl", _jsonl({"a": _chat(1)}, url="/v1/embeddings")),
                                    purpose="batch")


def test_another_tenant_sees_neither_the_batch_nor_its_files(stack):
    client = stack.client()
    file = client.files.create(file=("batch.jsonl", _jsonl({"a": _chat(1)})), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    other_key = f"tf-other-{uuid.uuid4().hex}"
    stack.redis().hset(p.API_KEYS_KEY, hash_key(other_key), json.dumps({"name": "other-tenant", "created": 0}))
    other = openai.OpenAI(base_url=stack.url + "/v1", api_key=other_key, max_retries=0)
    for call in (lambda: other.batches.retrieve(batch.id), lambda: other.batches.cancel(batch.id),
                 lambda: other.files.retrieve(file.id), lambda: other.files.content(file.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError, match="input_file_id|no batch input file"):
        other.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.id not in [b.id for b in other.batches.list().data]
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    assert client.files.retrieve(file.id).bytes == len(_jsonl({"a": _chat(1)}))


def test_cancel_stops_submitting_lines(stack, batch_worker):
    client = stack.client()
    bodies = {f"slow-{i}": _chat(i, max_tokens=48, ignore_eos=True) for i in range(60)}
    batch = _submit(client, bodies)
    _wait(client, batch.id, {"in_progress"}, 60, batch_worker)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = _wait(client, batch.id, {"cancelled", "completed"}, 60, batch_worker)
    assert batch.status == "cancelled" and batch.cancelled_at
    done = batch.request_counts.completed + batch.request_counts.failed
    assert done <= 24, batch.request_counts  # what was in flight when the cancel came, not the 60 lines
    if batch.request_counts.completed:
        output = client.files.content(batch.output_file_id).text.splitlines()
        assert len(output) == batch.request_counts.completed
    time.sleep(1.0)  # nothing more is submitted after the job ended
    assert client.batches.retrieve(batch.id).request_counts.completed == batch.request_counts.completed


def test_a_job_re_run_after_a_crash_answers_only_the_lines_left_and_resubmits_nothing(stack, batch_worker):
    client = stack.client()
    bodies = {f"again-{i}": _chat(i, max_tokens=4) for i in range(6)}
    batch = _wait(client, _submit(client, bodies).id, {"completed"}, 30, batch_worker)
    r = stack.redis()
    # as a crash leaves it: two lines answered by the stack but not recorded, the batch still in progress
    r.hdel(p.batch_output_key(batch.id), "again-1", "again-4")
    r.hset(p.batch_key(batch.id), "status", json.dumps("in_progress"))
    submitted = r.xlen(p.REQUESTS_STREAM)
    assert run_batch(stack.redis_url, batch.id) == {"total": 6, "completed": 6, "failed": 0}
    assert r.xlen(p.REQUESTS_STREAM) == submitted  # their reply streams were followed again
    batch = client.batches.retrieve(batch.id)
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert batch.status == "completed" and [line["custom_id"] for line in lines] == list(bodies)


def test_the_worker_hands_the_requests_priority_to_the_engine():
    seen = {}

    class Engine:
        engine = None

        async def generate(self, rid, ids, params, priority=0, resume=None, cache_salt=None):
            seen.update(priority=priority, cache_salt=cache_salt)
            for output in ():
                yield output

    worker = Worker.__new__(Worker)  # only what `_relay` touches
    worker.engine = Engine()
    request = p.GenerateRequest(request_id="r", kind="completion", model=MODEL, prompt="x",
                                sampling=p.SamplingOptions(), priority=p.BATCH_PRIORITY, cache_salt="salt")
    asyncio.run(worker._relay("r", [1], None, None, request, {}, {}, None))
    assert seen == {"priority": p.BATCH_PRIORITY, "cache_salt": "salt"}
    assert p.GenerateRequest(request_id="r", kind="completion", model=MODEL, prompt="x",
                             sampling=p.SamplingOptions()).priority == 0  # interactive requests


def test_a_batch_cannot_spend_past_its_keys_budget(stack, batch_worker):
    async def create_key() -> str:
        redis = connect(stack.redis_url)
        try:  # 12 output tokens at the small model's output price: a budget for about three lines' estimates
            price = PriceTable.load().price(MODEL)
            return await register_key(redis, f"batch-budget-{uuid.uuid4().hex[:6]}", budget_usd=3.5 * (
                40 * price.input + 12 * price.output) / 1e6, budget_period="total")
        finally:
            await redis.aclose()

    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=asyncio.run(create_key()), max_retries=0)
    batch = _wait(client, _submit(client, {f"b-{i}": _chat(i) for i in range(10)}).id, {"completed", "failed"}, 90,
                  batch_worker)
    assert 1 <= batch.request_counts.completed < 10 and batch.request_counts.failed >= 1
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"insufficient_quota"}


@pytest.mark.parametrize("limit", ["abc", "0", "1000"])
def test_a_bad_list_parameter_is_a_400_error_object_naming_it(stack, limit):
    response = httpx.get(stack.url + "/v1/batches", params={"limit": limit},
                         headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "limit" and response.json()["error"]["type"] == "invalid_request_error"
