"""`tokenfleet up`: the whole stack as local processes on embedded defaults, each restarted if it exits
(services/supervisor.py), all stopped cleanly on Ctrl-C."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from services.redis_client import EmbeddedRedis
from services.settings import GatewaySettings, RedisSettings, RouterSettings, cache_dir
from services.supervisor import Service, Supervisor

# The local stack's max_tokens for requests that set none: a reply, not the rest of an 8k context.
LOCAL_MAX_TOKENS = 256


def is_ready(url: str, models: set[str]) -> bool:
    """The gateway at `url` answers and reports a live worker for each of `models`."""
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
            workers = json.loads(response.read())["workers"]
    except OSError:
        return False
    return all(workers.get(m) for m in models)


def wait_ready(url: str, models: set[str], procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """True once the stack `is_ready`; False if a process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            return False
        if is_ready(url, models):
            return True
        time.sleep(0.5)
    return False


@dataclass
class LocalStack:
    url: str
    api_key: str
    redis_url: str
    supervisor: Supervisor
    embedded: EmbeddedRedis | None
    env: dict[str, str]  # what every service was started with

    @property
    def procs(self) -> list[subprocess.Popen]:
        return self.supervisor.procs

    def stop(self) -> None:
        self.supervisor.stop()
        if self.embedded is not None:
            self.embedded.close()


def local_dev_key() -> str:
    """The local stack's API key, made once and kept in the cache directory (`cat ~/.cache/tokenfleet/dev-key`),
    so scripts and the README's examples find it across restarts."""
    path = cache_dir() / "dev-key"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}")
        staging.write_text("tf-dev-" + secrets.token_urlsafe(16) + "\n")
        staging.chmod(0o600)
        staging.replace(path)
    return path.read_text().strip()


def start(host: str, port: int, workers: list[tuple[str, str]], env: dict[str, str] | None = None,
          worker_env: dict[str, str] | None = None) -> LocalStack:
    """Gateway, router, accounting, its Celery worker and a worker process per (model, tier), on REDIS_URL or an
    embedded Redis.
    `env` goes to every process, `worker_env` to the workers on top of it."""
    redis_url = RedisSettings().redis_url
    embedded = None if redis_url else EmbeddedRedis()
    redis_url = redis_url or embedded.url
    key = GatewaySettings().dev_key or local_dev_key()
    env = {"TOKENFLEET_ACCOUNTING_PORT": str(port + 1), "TOKENFLEET_WORKER_DEFAULT_MAX_TOKENS": str(LOCAL_MAX_TOKENS),
           **os.environ, **(env or {}), "REDIS_URL": redis_url, "TOKENFLEET_GATEWAY_DEV_KEY": key}
    cli = [sys.executable, "-m", "services.cli"]
    # CPU workers share the machine: split its cores between them instead of oversubscribing (each torch
    # thread pool spin-waits, and two pools on the same cores slow both and the gateway with them).
    threads = env.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // len(workers)))
    workers_env = {**env, "OMP_NUM_THREADS": threads, **(worker_env or {})}
    services = [Service("gateway", cli + ["gateway", "--host", host, "--port", str(port)], env),
                Service("router", cli + ["router"], env), Service("accounting", cli + ["accounting"], env),
                Service("celery", cli + ["celery"], env)]
    services += [Service(f"worker {model} ({tier})", cli + ["worker", "--model", model, "--tier", tier], workers_env)
                 for model, tier in workers]
    supervisor = Supervisor(services)
    supervisor.start()
    return LocalStack(f"http://{host}:{port}", key, redis_url, supervisor, embedded, env)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def up(host: str, port: int, workers: list[tuple[str, str]], ready_timeout_s: float = 600.0) -> int:
    """`workers`: (model, tier) pairs, one worker process each. A service that exits is restarted; Ctrl-C or
    SIGTERM (a service manager, `kill`) stops them all, each draining as on its own SIGTERM."""
    signal.signal(signal.SIGTERM, _interrupt)
    stack = start(host, port, workers)
    url, key, models = stack.url, stack.api_key, {model for model, _ in workers}
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not is_ready(url, models):
            if not stack.supervisor.check():
                return 1
            if time.monotonic() > deadline:
                print("tokenfleet: the stack did not become ready; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(f"\ntokenfleet is up: {url}/v1  (Redis {stack.redis_url})\n  API key: {key}  "
              f"(in {cache_dir() / 'dev-key'} unless TOKENFLEET_GATEWAY_DEV_KEY is set)\n"
              f"  models: {', '.join(sorted({model for model, _ in workers}))} (and auto)\n"
              f"  finance API: http://{host}:{stack.env['TOKENFLEET_ACCOUNTING_PORT']}/v1/ledger\n"
              f"  try: curl {url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
              "-H 'Content-Type: application/json' -d '{\"model\": \"auto\", \"max_tokens\": 64, \"temperature\": 0, "
              "\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'\n"
              "Ctrl-C stops everything.", flush=True)
        while stack.supervisor.check():
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def default_workers() -> list[tuple[str, str]]:
    """One worker per tier's model; one worker for both when they name the same model (the default)."""
    tiers = RouterSettings()
    if tiers.small_model == tiers.large_model:
        return [(tiers.small_model, "small,large")]
    return [(tiers.small_model, "small"), (tiers.large_model, "large")]
