"""The stack as ops run it: the image built, `docker compose up --wait` (the CPU override, on base images built
from Debian's packages: no image registry is reachable here), the real `openai` client through the gateway, the
ledger on the finance API, a worker killed mid-stream, `down -v`. Where no Docker engine answers, one is started
(infra/docker/engine.sh, as root); skipped, saying why, where that cannot be done (tests/containers.py)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from services.launcher.stack import wait_ready
from tests import containers
from tests.stack import _free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tokenfleet-small"
PROJECT_PREFIX = "tokenfleet-e2e-"
SERVICES = ["gateway", "router", "worker-small", "accounting"]  # and what they depend on: redis, postgres, migrate


def _run(*args: str, timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


class Compose:
    """One compose project of the stack: its command line, environment and the host's view of its ports."""

    def __init__(self, env: dict[str, str]):
        self.env, self.key = env, env["TOKENFLEET_GATEWAY_DEV_KEY"]
        self.gateway = f"http://127.0.0.1:{env['TOKENFLEET_GATEWAY_HOST_PORT']}"
        self.finance = f"http://127.0.0.1:{env['TOKENFLEET_FINANCE_HOST_PORT']}"
        self.command = ["docker", "compose", "-p", f"{PROJECT_PREFIX}{secrets.token_hex(3)}", "--env-file", os.devnull,
                        "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml"]

    def __call__(self, *args: str, timeout_s: float = 300) -> str:
        done = _run(*self.command, *args, timeout_s=timeout_s, env=self.env)
        assert done.returncode == 0, f"docker compose {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service).split()


@pytest.fixture(scope="module")
def compose():
    if reason := containers.docker_unavailable():  # else an engine answers, and the base images are built
        pytest.skip(reason)
    _remove_stale_stacks()
    stack = Compose({
        **os.environ, "REDIS_PASSWORD": secrets.token_hex(12), "POSTGRES_PASSWORD": secrets.token_hex(12),
        "TOKENFLEET_BASE_IMAGE": "tokenfleet-base:bookworm", "TOKENFLEET_REDIS_IMAGE": "tokenfleet-redis:bookworm",
        "TOKENFLEET_POSTGRES_IMAGE": "tokenfleet-postgres:bookworm",
        "TOKENFLEET_GATEWAY_DEV_KEY": f"tf-e2e-{secrets.token_hex(8)}",
        "TOKENFLEET_GATEWAY_HOST_PORT": str(_free_port()), "TOKENFLEET_FINANCE_HOST_PORT": str(_free_port()),
        # float32 runs the torch path: no CPU kernels compiled in each fresh container (a minute of the suite)
        "TOKENFLEET_WORKER_CPUS": "1", "TOKENFLEET_WORKER_DTYPE": "float32",
        "TOKENFLEET_OTLP_ENDPOINT": ""})  # traces off: no collector image can be had here
    try:
        stack("build", "migrate", timeout_s=1200)  # one image for every tokenfleet service
        stack("up", "-d", "--wait", "--scale", "worker-small=2", *SERVICES, timeout_s=600)
        assert wait_ready(stack.gateway, {MODEL}, [], 120), "the gateway never saw a worker"
        yield stack
    finally:
        logs = _run(*stack.command, "logs", "--no-color", "--tail", "60", timeout_s=60, env=stack.env)
        print(logs.stdout[-20000:])  # shown when a test failed
        down = _run(*stack.command, "down", "-v", "--timeout", "20", timeout_s=300, env=stack.env)
        print(down.stdout, down.stderr)


def _remove_stale_stacks() -> None:
    """Stacks of an earlier run that was killed before its `down` (they restart with dockerd: unless-stopped)."""
    listed = _run("docker", "compose", "ls", "-a", "--format", "json", timeout_s=60)
    for project in json.loads(listed.stdout or "[]"):
        if project["Name"].startswith(PROJECT_PREFIX):
            _run("docker", "compose", "-p", project["Name"], "down", "-v", "--timeout", "5", timeout_s=300)


def test_a_chat_through_the_composed_stack_is_answered_and_ledgered(compose):
    from openai import OpenAI

    client = OpenAI(base_url=compose.gateway + "/v1", api_key=compose.key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=8)
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    row = _ledger_row(compose, reply.id.removeprefix("chatcmpl-"))
    assert (row["status"], row["completion_tokens"]) == ("ok", reply.usage.completion_tokens)


def test_a_stream_whose_worker_is_killed_completes_once_on_the_other(compose):
    body = {"model": MODEL, "prompt": "Count on:", "max_tokens": 300, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    workers = compose.containers("worker-small")
    assert len(workers) == 2
    chunks, killed = [], None
    with httpx.stream("POST", compose.gateway + "/v1/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {compose.key}"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line[6:]))
            if killed is None and len(chunks) == 10:  # mid-stream: the worker serving it is SIGKILLed
                killed = _serving(compose, workers, chunks[0]["id"].split("-", 1)[1])
                subprocess.run(["docker", "kill", killed], check=True, capture_output=True, timeout=60)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert chunks[-1]["usage"]["completion_tokens"] == 300 and len("".join(texts)) > 0
    row = _ledger_row(compose, chunks[0]["id"].split("-", 1)[1])
    assert (row["status"], row["completion_tokens"]) == ("ok", 300)
    assert not row["worker_id"].startswith(killed[:12])  # finished by the other worker


def _serving(compose: Compose, workers: list[str], request_id: str) -> str:
    """The container of the worker serving `request_id` (a worker's id is its hostname, the container's short
    id, and its pid)."""
    ledgered = _run(*compose.command, "exec", "-T", "redis", "sh", "-c",
                    f'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli --raw XRANGE tf:reply:{request_id} - + COUNT 1',
                    timeout_s=60, env=compose.env)
    started = json.loads(next(line for line in ledgered.stdout.splitlines() if line.startswith("{")))
    return next(c for c in workers if started["worker_id"].startswith(c[:12]))


def _ledger_row(compose: Compose, request_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        page = httpx.get(compose.finance + "/v1/ledger", params={"limit": 100}, timeout=30,
                         headers={"Authorization": f"Bearer {compose.key}"}).json()
        for row in page["data"]:
            if row["request_id"] == request_id:
                return row
        time.sleep(0.5)
    raise AssertionError(f"no ledger row for {request_id} on the finance API")
