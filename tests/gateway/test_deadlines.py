"""Every request carries a deadline from the moment the gateway accepts it (the client's own timeout where it sends
one). Work past its deadline is never started, and is stopped where it runs; its ledger row says `expired` and bills
the tokens its client got. (A request a worker reclaims after its deadline: tests/faults/test_component_kills.py.)"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from services.base import protocol as p
from tests.faults.conftest import ended_replies, queued_request
from tests.stack import API_KEY, MODEL

LONG = 2000  # tokens: far more than the small model makes before a deadline of a few seconds


def test_a_request_whose_deadline_passed_in_the_queue_is_never_routed_to_a_worker(stack):
    request = queued_request(deadline=time.time() - 1)
    stack.redis().xadd(p.REQUESTS_STREAM, request.encode())
    chunks = ended_replies(stack.redis(), request.request_id)
    assert [(c.kind, c.error.code if c.error else None) for c in chunks] == [("error", "deadline_exceeded")]
    row = stack.ledger_row(f"x-{request.request_id}")
    assert (row.status, row.completion_tokens, row.sla_met) == ("expired", 0, False)


def test_a_stream_running_at_its_deadline_is_stopped_and_billed_the_tokens_its_client_got(stack):
    body = {"model": MODEL, "prompt": "Count on and on:", "max_tokens": LONG, "ignore_eos": True, "stream": True,
            "temperature": 0, "logprobs": 0}
    tokens, events = 0, []
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}", "x-request-timeout": "2.0"}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    tokens = sum(len((c["choices"][0].get("logprobs") or {}).get("tokens") or []) for c in chunks if "choices" in c)
    assert events[-1] == "[DONE]" and chunks[-1]["error"]["code"] == "deadline_exceeded"
    assert 0 < tokens < LONG, tokens
    request_id = chunks[0]["id"].split("-", 1)[1]
    row = stack.ledger_row_when(request_id, lambda row: row.completion_tokens == tokens)
    assert (row.status, row.completion_tokens) == ("expired", tokens)
    # stopped where it ran: nothing more was generated for it after its deadline
    assert not any(c.kind == "finished" for c in ended_replies(stack.redis(), request_id))


def test_a_non_streamed_request_ends_at_the_openai_clients_own_timeout_with_no_token_billed(stack):
    client = stack.client(max_retries=0, timeout=1.0)
    sent_at, started = time.time(), time.monotonic()
    with pytest.raises((openai.APITimeoutError, openai.APIStatusError)) as ended:
        client.completions.create(model=MODEL, prompt="Count on and on:", max_tokens=LONG, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert time.monotonic() - started < 5
    if isinstance(ended.value, openai.APIStatusError):  # the gateway's answer came a hair before the client gave up
        assert (ended.value.status_code, ended.value.code) == (504, "deadline_exceeded")
    r, deadline = stack.redis(), time.monotonic() + 20
    while True:  # the request the client gave up on: the one expired since it was sent
        expired = [e for e in p.completion_events(r.xrange(p.EVENTS_STREAM, min=f"{int(sent_at * 1000)}"))
                   if e.status == "expired" and e.enqueued_at >= sent_at]
        if expired or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    [event] = expired
    row = stack.ledger_row_when(event.request_id, lambda row: row.completion_tokens == 0)
    assert (row.status, row.completion_tokens) == ("expired", 0)
