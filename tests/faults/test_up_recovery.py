"""`tokenfleet up`'s own Redis killed with streams in flight: the supervisor starts it again from its append-only
file, the services ride the outage out (one log line as Redis goes and one as it comes back, not a traceback per
retry), every stream ends once with all its tokens, and serve again. The whole stack killed with streams in flight
and started again: each ledger row bills what its client got. And `tokenfleet up` started with SIGINT ignored, as a
script's background job is: a Ctrl-C to its process group stops every service, Redis last and saving, and restarts
none (one stack for all three, in order: the last test stops it). And a Redis that outlived a killed stack is
stopped, saving, before the next one's starts."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import redis as sync_redis

from bench.faults import Up
from services.base.redis_client import KeptRedis
from services.launcher.stack import embedded_redis
from services.text import builtin_models
from tests.faults.conftest import StreamResult, got_or_got_before_the_last_chunk, stream_completion
from tests.kept_redis import kept_redis_server
from tests.stack import API_KEY, MODEL, STACK_ENV, _free_port

RECOVERY_S = 20  # from the supervisor's resume to the first request served again
STREAM_TOKENS = 200  # long enough to be mid-stream at a fault
# As a shell runs a background job: SIGINT ignored, which the exec'd `tokenfleet up` inherits.
IGNORING_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.argv[1], sys.argv[1:])")


class UpStack(Up):
    """`tokenfleet up` on the test model, started as a script's background job is (SIGINT ignored)."""

    def ledger_when(self, request_ids: set[str], settled: Callable[[dict[str, list[tuple[str, int]]]], bool],
                    timeout_s: float = 60) -> dict[str, list[tuple[str, int]]]:
        """The rows of `request_ids` once they are `settled` (a row may be amended), or `timeout_s` on."""
        deadline = time.monotonic() + timeout_s
        while not settled(rows := self.ledger(request_ids)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return rows

    def chat(self) -> httpx.Response:
        return httpx.post(self.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "auto", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
                          timeout=60)

    def redis(self) -> sync_redis.Redis:
        """A client of its Redis, found as `tokenfleet keys` finds it."""
        state = json.loads((self.cache / "stack.json").read_text())
        return sync_redis.Redis.from_url(state["redis_url"], decode_responses=True, socket_timeout=5)


@pytest.fixture(scope="module")
def up_stack(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    for shared in ("kernels", "models"):  # the native kernels and checkpoints the rest of the suite made
        (builtin_models.cache_dir() / shared).mkdir(parents=True, exist_ok=True)
        (cache / shared).symlink_to(builtin_models.cache_dir() / shared, target_is_directory=True)
    one_worker = {**STACK_ENV, "TOKENFLEET_ROUTER_LARGE_MODEL": MODEL}  # of both tiers
    stack = UpStack(cache, _free_port(), one_worker, launcher=(sys.executable, "-c", IGNORING_SIGINT))
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def _streams(url: str, what: str, count: int, max_tokens: int) -> tuple[list[StreamResult], list[Future]]:
    """`count` streamed completions in flight, each filling its result as it goes, once each has a few tokens."""
    results = [StreamResult() for _ in range(count)]
    pool = ThreadPoolExecutor(count)
    futures = [pool.submit(stream_completion, url, f"{what} {i}:", max_tokens, progress=r)
               for i, r in enumerate(results)]
    pool.shutdown(wait=False)
    deadline = time.monotonic() + 120
    while min(r.tokens for r in results) < 5:
        assert time.monotonic() < deadline and not any(f.done() for f in futures), results
        time.sleep(0.05)
    return results, futures


def _logged_since(path: Path, offset: int, text: str, timeout_s: float = 10) -> str:
    """What `path` got after `offset`, once that has `text` (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with path.open() as log:
            log.seek(offset)
            written = log.read()
        if text in written or time.monotonic() > deadline:
            return written
        time.sleep(0.2)


def test_a_killed_redis_is_restarted_from_its_data_and_the_services_serve_again(up_stack):
    assert up_stack.chat().status_code == 200
    up_stack.redis().set("tokenfleet:test:kept", "before the kill")
    logs = {path: path.stat().st_size for path in (up_stack.cache / "logs").glob("*.log")}
    server = up_stack.redis_server()
    _, futures = _streams(up_stack.url, "Through a Redis kill", 4, STREAM_TOKENS)
    # The supervisor paused while Redis is down: an outage long enough to watch, the same length every run.
    os.kill(up_stack.proc.pid, signal.SIGSTOP)
    try:
        server.kill()
        while server.is_running() and server.status() != psutil.STATUS_ZOMBIE:  # its parent, paused, reaps it later
            time.sleep(0.01)
        refused = []
        for _ in range(4):
            refused.append(up_stack.chat())
            time.sleep(0.5)
    finally:
        os.kill(up_stack.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    while (reply := up_stack.chat()).status_code != 200:
        assert time.monotonic() < resumed + RECOVERY_S, (reply.status_code, reply.text, "".join(up_stack.console))
        time.sleep(0.2)

    outcomes = [f.result(timeout=120) for f in futures]
    assert all(r.status_code == 503 and r.headers.get("retry-after") for r in refused), [r.status_code for r in refused]
    for outcome in outcomes:  # ended once, whole: the outage was ridden out, each token sent once
        assert outcome.done and not outcome.cut and outcome.error is None, outcome
        assert outcome.tokens == outcome.usage_tokens == STREAM_TOKENS, outcome
    expected = {o.request_id: [("ok", STREAM_TOKENS)] for o in outcomes}
    assert up_stack.ledger_when(set(expected), expected.__eq__) == expected
    assert up_stack.said("tokenfleet: redis exited with code -9; restarting it in 1 s "
                         f"(its log: {up_stack.cache / 'logs' / 'redis.log'})"), "".join(up_stack.console)
    assert any(line.startswith("tokenfleet: redis restarted (pid ") for line in up_stack.console)
    assert up_stack.redis().get("tokenfleet:test:kept") == "before the kill"  # from the append-only file
    for path, offset in logs.items():
        if path.name.startswith(("worker", "accounting")):  # each loop: one line as Redis went, one as it came back
            written = _logged_since(path, offset, "Redis back after")
            assert "Redis unreachable (" in written and "Redis back after" in written, written
            assert "Traceback" not in written, written


def test_a_stack_killed_whole_with_streams_in_flight_bills_each_client_what_it_got_once_started_again(up_stack):
    """Its gateway died with its clients' connections: the one started in its place reads what each got from the
    dead one's journal and ends their requests; the new workers resume none past that."""
    _, futures = _streams(up_stack.url, "Through a whole-stack crash", 4, STREAM_TOKENS)
    up_stack.kill()
    outcomes = [f.result(timeout=60) for f in futures]
    assert all(o.cut and 5 <= o.tokens < STREAM_TOKENS for o in outcomes), outcomes
    up_stack.start()
    billable = {o.request_id: [[("cancelled", n)] for n in got_or_got_before_the_last_chunk(o)] for o in outcomes}
    rows = up_stack.ledger_when(set(billable), lambda rows: all(rows.get(rid) in ok for rid, ok in billable.items()))
    assert all(rows.get(rid) in ok for rid, ok in billable.items()), (rows, outcomes)
    assert up_stack.chat().status_code == 200


def test_a_ctrl_c_to_its_process_group_stops_every_service_once_though_it_was_started_ignoring_sigint(up_stack):
    up_stack.redis().set("tokenfleet:test:kept", "before the stop")
    services = psutil.Process(up_stack.proc.pid).children(recursive=True)
    assert len(services) >= 6, services  # Redis, the gateway, router, accounting, Celery and a worker
    said = len(up_stack.console)
    os.killpg(up_stack.proc.pid, signal.SIGINT)  # as a Ctrl-C in its terminal (Redis, in its own session, aside)
    assert up_stack.proc.wait(90) == 0
    up_stack.reader.join(10)
    assert not [s for s in services if s.is_running() and s.status() != psutil.STATUS_ZOMBIE]
    assert not [line for line in up_stack.console[said:] if "restart" in line], up_stack.console[said:]

    with kept_redis_server(KeptRedis(up_stack.cache / "redis")) as kept:  # stopped last, saving: its data is kept
        assert kept.get("tokenfleet:test:kept") == "before the stop"


def test_a_redis_that_outlived_a_killed_stack_is_stopped_saving_before_its_successor_starts(tmp_path):
    with kept_redis_server(KeptRedis(tmp_path)) as orphan:
        orphan.set("tokenfleet:test:kept", "before the stack was killed")
        embedded_redis(tmp_path)  # as `tokenfleet up` starts: two servers must not write one append-only file
        with pytest.raises(sync_redis.ConnectionError):
            orphan.ping()
    with kept_redis_server(KeptRedis(tmp_path)) as successor:
        assert successor.get("tokenfleet:test:kept") == "before the stack was killed"
