"""Each component SIGKILLed in turn under a steady load (router, one of two workers, accounting, one of two
gateways), the dead one started again: every request a surviving gateway accepted completes exactly once with
all its tokens, the ledger has one row per request with the tokens its client got (those of the killed gateway's
clients too: the gateway started again reads them from its predecessor's journal), and every budget reservation is
settled to the ledger's cost. And the Celery worker SIGKILLed in the middle of a Batch API job: another job finishes
the batch within a minute, every line run once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil

from services.base import protocol as p
from services.base.redis_client import connect
from services.batch.store import line_request_id
from services.launcher.stack import wait_ready
from services.tenancy.auth import authenticate, register_key
from services.tenancy.budgets import budget_state, reservation_key
from tests.faults.conftest import (
    StreamResult,
    ended_replies,
    got_or_got_before_the_last_chunk,
    queued_request,
    stream_completion,
)
from tests.stack import API_KEY, MODEL

CLIENTS = 6
MAX_TOKENS = 48


def _budgeted_key(redis_url: str) -> str:
    async def create() -> str:
        redis = connect(redis_url)
        try:
            return await register_key(redis, "fault-tenant", budget_usd=1000.0)
        finally:
            await redis.aclose()

    return asyncio.run(create())


def _budget(redis_url: str, key: str):
    async def read():
        redis = connect(redis_url)
        try:
            return await budget_state(redis, await authenticate(redis, f"Bearer {key}"))
        finally:
            await redis.aclose()

    return asyncio.run(read())


class Load:
    """`CLIENTS` clients sending streamed completions back to back, alternating between the two gateways,
    until stopped. A request whose gateway died under it is recorded as cut (by that gateway, not lost), with the
    tokens it got when the stream had started."""

    def __init__(self, stack, key: str):
        self.stack, self.key = stack, key
        self.stopping = threading.Event()
        self.results: list[tuple[str, StreamResult]] = []
        self.cut: list[str] = []

    def client(self, n: int) -> None:
        i = 0
        while not self.stopping.is_set():
            url = (self.stack.url, self.stack.second_url)[(n + i) % 2]
            i += 1
            try:
                result = stream_completion(url, f"Client {n} request {i}:", MAX_TOKENS, self.key)
            except httpx.TransportError:  # refused: the gateway was down
                self.cut.append(url)
                time.sleep(0.2)
                continue
            self.results.append((url, result))
            if result.cut:
                self.cut.append(url)


def test_killing_each_component_in_turn_loses_and_repeats_nothing(fault_stack):
    key = _budgeted_key(fault_stack.redis.url)
    load = Load(fault_stack, key)
    with ThreadPoolExecutor(CLIENTS) as pool:
        clients = [pool.submit(load.client, n) for n in range(CLIENTS)]
        time.sleep(4)
        for name in ("router", "worker", "accounting", "gateway-2"):
            proc = fault_stack.procs[name]
            proc.kill()
            proc.wait()
            time.sleep(1.5)
            if name != "worker":  # the other worker carries the load (and adopts the dead one's inbox)
                fault_stack.start(name, *proc.args[3:])
            time.sleep(5)
        time.sleep(3)
        load.stopping.set()
        for client in clients:
            client.result(timeout=240)

    accepted = [(url, r) for url, r in load.results if r.status == 200]
    survived = [r for url, r in accepted if url == fault_stack.url]
    assert len(survived) >= 20 and all(url == fault_stack.second_url for url in load.cut)
    whole = [r for _, r in accepted if not r.cut]
    for result in whole:  # every token once, the whole completion: no error, no repeat
        assert result.done and result.error is None and result.tokens == result.usage_tokens == MAX_TOKENS, result
    assert wait_ready(fault_stack.second_url, {MODEL}, [], 60)  # the restarted gateway serves again
    assert stream_completion(fault_stack.second_url, "After the kills:", 4, key).done
    ledger = fault_stack.ledger({r.request_id for _, r in accepted if r.request_id}, timeout_s=60)
    assert len(ledger) == len([r for _, r in accepted if r.request_id])
    assert all(ledger[r.request_id]["status"] == "ok" and ledger[r.request_id]["completion_tokens"] == MAX_TOKENS
               for r in whole)
    cut = [r for _, r in accepted if r.cut and r.request_id]
    assert fault_stack.misbilled(cut, got_or_got_before_the_last_chunk) == {}

    r = fault_stack.redis.client()
    deadline = time.monotonic() + 30
    while any(r.hget(reservation_key(rid), "state") != "settled" for rid in ledger):
        assert time.monotonic() < deadline, "a finished request's budget reservation was never settled"
        time.sleep(0.3)
    deadline = time.monotonic() + 30
    while True:  # what the killed gateway's clients got is charged, and settled as its rows say
        charged = sum(float(row["list_cost_usd"]) for row in fault_stack.ledger_of_tenant("fault-tenant"))
        if abs(_budget(fault_stack.redis.url, key).spent_usd - charged) < 1e-6:
            break
        assert time.monotonic() < deadline, "the budget's spending is not the ledger's cost"
        time.sleep(0.5)


def test_a_gateway_killed_mid_stream_bills_each_client_the_tokens_it_got(fault_stack):
    """Its clients' connections die with it; the gateway started in its place reads their counts from its journal
    and ends their requests: each row bills what its client got, and says cancelled."""
    streams = [StreamResult() for _ in range(8)]
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(stream_completion, fault_stack.second_url, f"Mid-stream kill {i}:", 400,
                               progress=result) for i, result in enumerate(streams)]
        deadline = time.monotonic() + 90
        while min(result.tokens for result in streams) < 5:
            assert time.monotonic() < deadline, "the streams did not get going"
            time.sleep(0.05)
        gateway = fault_stack.procs["gateway-2"]
        gateway.kill()
        gateway.wait()
        outcomes = [f.result(timeout=60) for f in futures]
    fault_stack.start("gateway-2", *gateway.args[3:])  # as the supervisor restarts it
    assert all(o.cut and 5 <= o.tokens < 400 for o in outcomes), outcomes
    assert fault_stack.misbilled(outcomes, got_or_got_before_the_last_chunk) == {}
    rows = fault_stack.ledger({o.request_id for o in outcomes})
    assert {row["status"] for row in rows.values()} == {"cancelled"}
    assert wait_ready(fault_stack.second_url, {MODEL}, [], 60)


def test_a_request_reclaimed_after_its_deadline_is_not_run_and_is_ledgered_expired(fault_stack):
    """A worker took the request and died before running it; when a live worker reclaims it, its client has given
    up: it is acknowledged with an error, never started."""
    r, stream = fault_stack.redis.client(), p.work_stream(MODEL)
    request = queued_request(deadline=time.time() + 0.3)
    r.xadd(stream, request.encode())
    taken = r.xreadgroup(p.WORKER_GROUP, "a-worker-that-died", {stream: ">"}, count=1)
    assert [json.loads(fields[p.FIELD])["request_id"] for _, fields in taken[0][1]] == [request.request_id]
    chunks = ended_replies(r, request.request_id)  # once a janitor found the dead worker's entry stale
    assert [(c.kind, c.error.code if c.error else None) for c in chunks] == [("error", "deadline_exceeded")]
    row = fault_stack.ledger({request.request_id})[request.request_id]
    assert (row["status"], row["completion_tokens"]) == ("expired", 0)
    assert r.xpending_range(stream, p.WORKER_GROUP, "-", "+", 10, consumername="a-worker-that-died") == []


def _line_requests(r, request_ids: set[str]) -> Counter:
    """How many times each of `request_ids` was put on the request stream."""
    sent = Counter()
    for _, fields in r.xrange(p.REQUESTS_STREAM):
        request_id = json.loads(fields[p.FIELD]).get("request_id")
        if request_id in request_ids:
            sent[request_id] += 1
    return sent


def test_a_batch_whose_celery_worker_is_killed_mid_run_completes_with_every_line_run_once(fault_stack):
    lease = {"TOKENFLEET_ACCOUNTING_BATCH_LEASE_S": "3", "TOKENFLEET_ACCOUNTING_BATCH_SWEEP_INTERVAL_S": "2"}
    fault_stack.start("celery", "celery", **lease)
    client = openai.OpenAI(base_url=fault_stack.url + "/v1", api_key=API_KEY, max_retries=0)
    bodies = {f"line-{i}": {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}],
                            "max_tokens": 24, "temperature": 0, "ignore_eos": True} for i in range(32)}
    lines = "".join(json.dumps({"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": b}) + "\n"
                    for c, b in bodies.items())
    file = client.files.create(file=("batch.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    r = fault_stack.redis.client()
    deadline = time.monotonic() + 120
    while r.hlen(p.batch_output_key(batch.id)) < 6:
        assert time.monotonic() < deadline, "the batch job did not start"
        time.sleep(0.1)
    worker = fault_stack.procs["celery"]
    beat = psutil.Process(worker.pid).children()  # Celery's embedded beat
    worker.kill()  # mid-run: lines answered, lines in the stack, lines not yet sent
    worker.wait()
    _, alive = psutil.wait_procs(beat, timeout=10)
    assert beat and not alive, "the killed worker's beat lives on (and the restarted worker starts another)"
    answered_at_kill = r.hlen(p.batch_output_key(batch.id))
    fault_stack.start("celery", "celery", **lease)  # as the supervisor restarts it

    deadline = time.monotonic() + 180
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, f"the batch is {batch.status} after its worker was killed"
        time.sleep(0.5)
    assert answered_at_kill < len(bodies)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(bodies), 0)
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == list(bodies)
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 24 for line in output)
    request_ids = {line_request_id(batch.id, custom_id) for custom_id in bodies}
    assert _line_requests(r, request_ids) == Counter(dict.fromkeys(request_ids, 1))  # none submitted twice
    ledger = fault_stack.ledger(request_ids, timeout_s=60)
    assert len(ledger) == len(bodies) and all(row["status"] == "ok" for row in ledger.values())
