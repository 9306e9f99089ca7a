"""Redis killed (SIGKILL) under load and started again from its append-only file: new requests meanwhile get
503 + Retry-After, every stream already accepted ends with all its tokens and [DONE] (or with an error event
and [DONE]), its usage counts exactly what the client received, the ledger's status says which, and every
service goes on serving without a restart. An outage longer than a gateway waits (TOKENFLEET_REDIS_OUTAGE_S) ends
its streams with an error event and [DONE] while Redis is still down, and the requests are cancelled, and ledgered
as such with the tokens their clients got, once it is back."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from services.base import protocol as p
from services.launcher.stack import wait_ready
from tests.faults.conftest import stream_completion
from tests.stack import API_KEY, MODEL, _free_port

STREAMS = 10
MAX_TOKENS = 160  # long enough that every stream is mid-generation when Redis dies
DOWN_S = 10  # as long as the outage the issue measured; under TOKENFLEET_REDIS_OUTAGE_S (60 s)


def test_redis_killed_under_load_every_stream_ends_whole_or_with_an_error_and_the_ledger_agrees(fault_stack):
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(stream_completion, fault_stack.url, f"Stream {i} under a Redis restart:", MAX_TOKENS)
                   for i in range(STREAMS)]
        # mid-generation: the worker has published tokens of every stream
        r = fault_stack.redis.client()
        deadline = time.monotonic() + 90
        while sum(1 for key in r.scan_iter(p.reply_stream("*")) if r.xlen(key) > 5) < STREAMS:
            assert time.monotonic() < deadline, "the streams did not get going"
            time.sleep(0.1)
        fault_stack.redis.kill()
        refused = []
        down_until = time.monotonic() + DOWN_S
        while time.monotonic() < down_until:
            refused.append(httpx.post(fault_stack.url + "/v1/completions", timeout=30,
                                      headers={"Authorization": f"Bearer {API_KEY}"},
                                      json={"model": MODEL, "prompt": "while Redis is down", "max_tokens": 4}))
            time.sleep(0.5)
        fault_stack.redis.start()
        outcomes = [f.result(timeout=240) for f in futures]

    assert refused and all(r.status_code == 503 for r in refused), [r.status_code for r in refused]
    assert all(r.headers.get("retry-after") and r.json()["error"]["code"] == "service_unavailable" for r in refused)
    assert all(o.status == 200 and o.done for o in outcomes), "a stream was cut without [DONE]"
    complete = [o for o in outcomes if o.error is None]
    for outcome in complete:  # each token exactly once: none lost in the outage, none repeated by the resume
        assert outcome.tokens == outcome.usage_tokens == MAX_TOKENS, outcome
    assert len(complete) == STREAMS, [o.error for o in outcomes]  # a 10 s outage is ridden out, not failed
    ledger = fault_stack.ledger({o.request_id for o in outcomes})
    assert len(ledger) == STREAMS
    for outcome in outcomes:
        row = ledger[outcome.request_id]
        assert (row["status"], row["completion_tokens"]) == ("ok", outcome.tokens)

    after = httpx.post(fault_stack.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, "prompt": "after the restart", "max_tokens": 4})
    assert after.status_code == 200, after.text  # gateway, router, worker and accounting reconnected by themselves


def test_an_outage_longer_than_the_gateway_waits_ends_each_stream_with_an_error_and_cancels_it(fault_stack):
    port = _free_port()
    gateway = fault_stack.start("gateway-brief", "gateway", "--port", str(port), TOKENFLEET_REDIS_OUTAGE_S="1.5")
    url = f"http://127.0.0.1:{port}"
    assert wait_ready(url, {MODEL}, [gateway], 120)
    r = fault_stack.redis.client()
    earlier = set(r.scan_iter(p.reply_stream("*")))  # the other test's streams
    with ThreadPoolExecutor(4) as pool:
        # Longer than MAX_TOKENS: one request's start delayed (its router retrying after a stale connection)
        # must not let the others finish before Redis is killed.
        futures = [pool.submit(stream_completion, url, f"Stream {i} through a long outage:", 4 * MAX_TOKENS)
                   for i in range(4)]
        deadline = time.monotonic() + 90
        while sum(1 for key in set(r.scan_iter(p.reply_stream("*"))) - earlier if r.xlen(key) > 5) < 4:
            assert time.monotonic() < deadline, "the streams did not get going"
            time.sleep(0.1)
        fault_stack.redis.kill()
        outcomes = [f.result(timeout=60) for f in futures]  # while Redis is still down: none hangs
        fault_stack.redis.start()

    for outcome in outcomes:
        assert outcome.status == 200 and outcome.done, outcome
        assert outcome.error["code"] == "service_unavailable" and outcome.tokens < 4 * MAX_TOKENS, outcome
    # cancelled once Redis is back: on its worker, or, if the worker finished it first, in the ledger
    ledger = fault_stack.ledger({o.request_id for o in outcomes}, timeout_s=90, status="cancelled")
    assert {rid: row["status"] for rid, row in ledger.items()} == {o.request_id: "cancelled" for o in outcomes}
    assert fault_stack.misbilled(outcomes) == {}  # each billed what it got
