"""A running stack for the service tests: real Redis (REDIS_URL, else embedded), the gateway, the router
and two workers of the small built-in model as separate processes, as `tokenfleet up` runs them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import redis as sync_redis

from services.base import protocol as p
from services.launcher.stack import wait_ready

MODEL = "tokenfleet-small"
API_KEY = "tf-test-key"
# Exactness is checked in float32 (see DEVELOPERS.md); delivery rules tightened so failover tests are quick.
STACK_ENV = {
    "TOKENFLEET_WORKER_DTYPE": "float32",
    "TOKENFLEET_WORKER_MAX_NUM_SEQS": "12",  # 20 concurrent requests spread over both workers
    "TOKENFLEET_WORKER_KV_CACHE_MEMORY_BYTES": str(256 << 20),
    "TOKENFLEET_WORKER_HEARTBEAT_INTERVAL_S": "0.3",
    "TOKENFLEET_WORKER_HEARTBEAT_TTL_S": "1.5",
    "TOKENFLEET_CLAIM_IDLE_MS": "1500",
    "TOKENFLEET_JANITOR_INTERVAL_S": "0.3",
    "TOKENFLEET_GATEWAY_DEV_KEY": API_KEY,
    "TOKENFLEET_ROUTER_SMALL_MODEL": MODEL,  # model="auto" chooses between the built-ins here
    "TOKENFLEET_ROUTER_LARGE_MODEL": "tokenfleet-large",
    "OMP_NUM_THREADS": "1",
}


def worker_metric(status: p.WorkerStatus, name: str, default: float | None = None) -> float:
    """One sample of a worker's Prometheus metrics (the first series of `name`); `default` when it has none
    (a labelled histogram appears with its first observation)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{status.metrics_port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"{name} not in the worker's metrics")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    redis_url: str
    url: str
    small_queue_url: str  # a second gateway whose queue depth is 2
    env: dict[str, str]
    database_url: str  # the ledger's (the accounting service writes it)
    trace_file: Path  # every service's spans, one JSON document per line
    workers: list[subprocess.Popen] = field(default_factory=list)
    others: list[subprocess.Popen] = field(default_factory=list)

    def client(self, base: str | None = None, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=(base or self.url) + "/v1", api_key=API_KEY, **kwargs)

    def key_client(self, name: str, **key_fields) -> openai.OpenAI:
        """A client with a new API key of tenant `name` (`register_key`'s limits and options as keywords)."""
        from services.base.redis_client import connect
        from services.tenancy.auth import register_key

        async def create() -> str:
            redis = connect(self.redis_url)
            try:
                return await register_key(redis, name, **key_fields)
            finally:
                await redis.aclose()

        return openai.OpenAI(base_url=self.url + "/v1", api_key=asyncio.run(create()))

    def redis(self) -> sync_redis.Redis:
        return sync_redis.Redis.from_url(self.redis_url, decode_responses=True)

    def start_worker(self, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """A worker of the small model, or of what `flags` say (`--model`, `--served-model-name`, ...)."""
        flags = flags or ("--model", MODEL, "--tier", "small")
        proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "worker", *flags],
                                env={**self.env, **(env or {})})
        self.workers.append(proc)
        return proc

    @staticmethod
    def wait_stopped(proc: subprocess.Popen, timeout_s: float = 60) -> int:
        """`proc`'s exit status once it has stopped (a loaded 2-core host took over 30 s to drain a worker). One that
        does not stop in time prints its threads' and asyncio tasks' stacks (captured with the test's output), is
        killed, and fails the test."""
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            proc.send_signal(signal.SIGUSR2)
            time.sleep(2)
            proc.kill()
            raise AssertionError(f"process {proc.pid} did not stop within {timeout_s:.0f} s of SIGTERM") from None

    def wait_for_worker(self, proc: subprocess.Popen, model: str = MODEL, timeout_s: float = 180) -> None:
        """Until `proc` heartbeats as a worker of `model`."""
        deadline = time.monotonic() + timeout_s
        while not any(s.worker_id.endswith(f"-{proc.pid}") for s in self.worker_statuses(model)):
            assert time.monotonic() < deadline and proc.poll() is None, "the worker did not come up"
            time.sleep(0.3)

    def completion_event(self, response_id: str, timeout_s: float = 10) -> p.CompletionEvent:
        """The completion event of the request behind an OpenAI response id (`chatcmpl-<request id>`)."""
        request_id = response_id.split("-", 1)[1]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in p.completion_events(self.redis().xrange(p.EVENTS_STREAM)):
                if event.request_id == request_id:
                    return event
            time.sleep(0.1)
        raise AssertionError(f"no completion event for {request_id}")

    def ledger_row(self, response_id: str, timeout_s: float = 10):
        """The ledger row of the request behind an OpenAI response id, once the accounting service wrote it."""
        from sqlalchemy import select

        from services.accounting import db
        from services.accounting.models import LedgerRow

        request_id = response_id.split("-", 1)[1]
        engine = db.connect(self.database_url)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                with engine.connect() as connection:
                    row = connection.execute(select(LedgerRow).where(LedgerRow.request_id == request_id)).first()
                if row is not None:
                    return row
                time.sleep(0.1)
        finally:
            engine.dispose()
        raise AssertionError(f"no ledger row for {request_id}")

    def ledger_row_when(self, request_id: str, ready, timeout_s: float = 20):
        """The request's ledger row once `ready(row)` holds, or `timeout_s` passed (a row may be amended after it is
        written: a gateway's count of what its client got)."""
        deadline = time.monotonic() + timeout_s
        while True:
            row = self.ledger_row(f"x-{request_id}", timeout_s)
            if ready(row) or time.monotonic() > deadline:
                return row
            time.sleep(0.2)

    def worker_statuses(self, model: str = MODEL) -> list[p.WorkerStatus]:
        r = self.redis()
        return [p.WorkerStatus.model_validate_json(raw) for key in r.scan_iter(f"{p.PREFIX}:heartbeat:{model}:*")
                if (raw := r.get(key))]


@pytest.fixture(scope="session")
def stack(redis_url, new_database, tmp_path_factory):
    sync_redis.Redis.from_url(redis_url).flushdb()
    database_url, trace_file = new_database(), tmp_path_factory.mktemp("traces") / "spans.jsonl"
    env = {**os.environ, **STACK_ENV, "REDIS_URL": redis_url, "DATABASE_URL": database_url,
           "TOKENFLEET_ACCOUNTING_PORT": str(_free_port()), "TOKENFLEET_TRACE_FILE": str(trace_file),
           "TOKENFLEET_GATEWAY_JOURNAL_DIR": str(tmp_path_factory.mktemp("gateway-journal"))}
    port, small_port = _free_port(), _free_port()
    stack = Stack(redis_url, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{small_port}", env, database_url,
                  trace_file)
    cli = [sys.executable, "-m", "services.launcher.cli"]
    stack.others = [
        subprocess.Popen(cli + ["gateway", "--port", str(port)], env=env),
        subprocess.Popen(cli + ["gateway", "--port", str(small_port)],
                         env={**env, "TOKENFLEET_GATEWAY_MAX_QUEUE_DEPTH": "2"}),
        subprocess.Popen(cli + ["router"], env=env),
        subprocess.Popen(cli + ["accounting"], env=env),
    ]
    stack.start_worker()
    stack.start_worker()
    try:
        assert wait_ready(stack.url, {MODEL}, stack.others, 300), "the stack did not come up"
        assert wait_ready(stack.small_queue_url, {MODEL}, stack.others, 60)
        yield stack
    finally:
        for proc in stack.others + stack.workers:
            proc.terminate()
        for proc in stack.others + stack.workers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="session")
def reference_llm():
    from gpu_worker.engine import LLM

    return LLM(model=MODEL, dtype="float32", kv_cache_memory_bytes=128 << 20)
