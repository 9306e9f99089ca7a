"""Nothing accepted is lost: a killed worker's requests resume elsewhere, exactly once; a client that
leaves frees its KV blocks; a repeated Idempotency-Key runs once."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from gpu_worker.engine import SamplingParams
from services.base import protocol as p
from tests.stack import API_KEY, MODEL, worker_metric

PROMPTS = [f"Request number {i} says:" for i in range(12)]
MAX_TOKENS = 160  # long enough that the victim dies mid-generation
# A cancel reaches the worker within a second or so; a 2-core host running the whole stack and the suite can
# take a few more. The tests also check that the request did not simply run to its end in that time.
CANCEL_WITHIN_S = 20


def _params(i: int) -> dict:
    """Even requests greedy, odd ones seeded sampling: both must resume to the uninterrupted text.

    Sampling keeps to the top 8 tokens: the built-in model's random weights give a near-uniform distribution
    over 32 000 tokens, where the last-bit difference between a resumed prefill and the original decode
    steps moves an inverse-CDF draw across a neighbour's boundary; the test is about seed and position."""
    return {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "top_k": 8, "seed": 100 + i}


def _wait_for_workers(stack, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len([s for s in stack.worker_statuses() if not s.draining]) < count:
        assert time.monotonic() < deadline, "workers did not come up"
        time.sleep(0.3)


def test_killing_one_of_two_workers_mid_stream_loses_and_repeats_nothing(stack, reference_llm):
    _wait_for_workers(stack, 2)
    dead_letters_before = stack.redis().xlen(p.DEAD_LETTER_STREAM)
    client = stack.client(timeout=120)
    texts: dict[int, list[str]] = {i: [] for i in range(len(PROMPTS))}
    token_counts: dict[int, int] = {}
    progress = threading.Semaphore(0)

    def run(i: int) -> None:
        params = _params(i)
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, stream=True,
                                           stream_options={"include_usage": True}, seed=params.get("seed"),
                                           temperature=params["temperature"],
                                           extra_body={"ignore_eos": True, "top_k": params.get("top_k", -1)})
        for chunk in stream:
            if chunk.choices:
                texts[i].append(chunk.choices[0].text)
                progress.release()
            elif chunk.usage:
                token_counts[i] = chunk.usage.completion_tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    assert progress.acquire(timeout=60)  # tokens are flowing: kill the busiest worker mid-generation
    deadline = time.monotonic() + 30
    while (busiest := max(stack.worker_statuses(), key=lambda s: s.running)).running < 3:
        assert time.monotonic() < deadline, "no worker got busy"
        time.sleep(0.05)
    victim = next(w for w in stack.workers if busiest.worker_id.endswith(f"-{w.pid}"))
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    for t in threads:
        t.join(180)
    stack.start_worker()  # for the tests after this one

    wants = reference_llm.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **_params(i))
                                             for i in range(len(PROMPTS))])
    for i, want in enumerate(wants):
        assert "".join(texts[i]) == want.text, f"request {i}"
        assert token_counts[i] == MAX_TOKENS
    assert stack.redis().xlen(p.DEAD_LETTER_STREAM) == dead_letters_before


def test_client_disconnect_aborts_the_request_and_frees_its_kv_blocks(stack):
    body = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        request_id = response.headers["x-request-id"]
        started = p.decode(p.ReplyChunk, stack.redis().xrange(p.reply_stream(request_id))[0][1])
        status = next(s for s in stack.worker_statuses() if s.worker_id == started.worker_id)
        assert worker_metric(status, "tokenfleet:kv_blocks_used") > 0
    deadline = time.monotonic() + CANCEL_WITHIN_S
    while worker_metric(status, "tokenfleet:kv_blocks_used") or worker_metric(
            status, "tokenfleet:num_requests_running"):
        assert time.monotonic() < deadline, "the worker kept the aborted request"
        time.sleep(0.1)
    assert not _finished(request_id, stack), "the worker generated all 1500 tokens for nobody"
    # billed what was sent before it left
    row = stack.ledger_row_when(request_id, lambda row: row.status == "cancelled")
    assert row.status == "cancelled" and 1 <= row.completion_tokens < 1500, (row.status, row.completion_tokens)


def test_repeated_idempotency_key_runs_once_and_returns_the_same_body(stack):
    headers = {"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": f"key-{time.time_ns()}"}
    body = {"model": MODEL, "prompt": "Idempotent", "max_tokens": 8, "temperature": 1.0}
    first = httpx.post(stack.url + "/v1/completions", json=body, headers=headers, timeout=60)
    second = httpx.post(stack.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json()
    request_id = first.json()["id"].removeprefix("cmpl-")
    events = p.completion_events(stack.redis().xrange(p.EVENTS_STREAM))
    assert sum(e.request_id == request_id for e in events) == 1


def test_a_non_streaming_client_that_gives_up_cancels_its_request(stack):
    prompt = f"Leave me {time.time_ns()}"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2000, "ignore_eos": True}
    try:
        httpx.post(stack.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=1.0)
        raise AssertionError("a 2000-token completion came back within a second")
    except httpx.ReadTimeout:
        pass
    request = next(r for _, f in reversed(stack.redis().xrange(p.REQUESTS_STREAM))
                   if (r := p.decode(p.GenerateRequest, f)).prompt == prompt)
    # its worker stopped it: the event it writes when it drops a request (another test's work may keep it busy)
    event = stack.completion_event(f"cmpl-{request.request_id}", timeout_s=CANCEL_WITHIN_S)
    assert event.status == "cancelled" and event.usage.completion_tokens < 2000, event
    replies = [p.decode(p.ReplyChunk, f) for _, f in stack.redis().xrange(p.reply_stream(request.request_id))]
    assert replies[-1].kind == "error" and replies[-1].error.code == "cancelled"
    assert not _finished(request.request_id, stack), "the worker generated all 2000 tokens for nobody"
    # a response not streamed reached its client not at all: no completion token is billed
    row = stack.ledger_row_when(request.request_id, lambda row: row.completion_tokens == 0)
    assert (row.status, row.completion_tokens) == ("cancelled", 0)


def _finished(request_id: str, stack) -> bool:
    return any(p.decode(p.ReplyChunk, f).kind == "finished"
               for _, f in stack.redis().xrange(p.reply_stream(request_id)))
