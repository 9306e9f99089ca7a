"""Worker choice end to end: two workers of one model behind the gateway; requests sharing a long system
prompt go to the worker whose prefix cache holds it while loads are level, a flood of one prompt spreads
over both, and every decision is on the completion event."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.stack import MODEL

pytestmark = pytest.mark.usefixtures("stack")


def _system_prompt() -> str:
    topic = uuid.uuid4().hex
    return f"You are the support assistant of shop {topic}. " + " ".join(
        f"Rule {i}: answer politely, cite the order number, and never promise refunds over {i * 10} euros."
        for i in range(12))


def _ask(stack, system: str, question: str):
    return stack.client().chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])


def _settle() -> None:
    time.sleep(1.0)  # workers publish prefix-cache changes with their heartbeat (every 0.3 s here)


def test_requests_sharing_a_long_prefix_go_to_the_worker_holding_it(stack):
    system = _system_prompt()
    first = stack.completion_event(_ask(stack, system, "Where is my parcel?").id)
    holder = first.worker_id
    events = []
    for question in ("Can I change my address?", "Do you ship abroad?", "What is your phone number?"):
        _settle()
        events.append(stack.completion_event(_ask(stack, system, question).id))
    assert [e.worker_id for e in events] == [holder] * 3
    for event in events:
        assert event.routing.worker == holder and event.routing.prefix_tokens >= 256
        assert "prefix" in event.routing.worker_reason and event.routing.decision_ms is not None
        assert event.usage.cached_tokens >= event.routing.prefix_tokens  # the engine did reuse it


def test_requests_without_a_shared_prefix_spread_over_both_workers(stack):
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: _ask(stack, _system_prompt(), "Hello?"), range(8)))
    workers = {stack.completion_event(r.id).worker_id for r in responses}
    assert len(workers) == 2


def test_a_flood_of_one_prefix_spreads_over_both_workers(stack):
    system = _system_prompt()
    seed = stack.completion_event(_ask(stack, system, "First question?").id)
    _settle()
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda i: _ask(stack, system, f"Question number {i}?"), range(16)))
    served = [stack.completion_event(r.id).worker_id for r in responses]
    assert served.count(seed.worker_id) >= 4  # the holder takes what its cache is worth
    assert len(set(served)) == 2  # and the rest spills to the other worker
