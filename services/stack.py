"""`tokenfleet up`: the whole stack as local processes on embedded defaults, stopped cleanly on Ctrl-C."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request

from services.redis_client import EmbeddedRedis
from services.settings import GatewaySettings, RedisSettings, RouterSettings


def wait_ready(url: str, models: set[str], procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """True once the gateway reports a live worker for each of `models`; False if a process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            return False
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
                workers = json.loads(response.read())["workers"]
                if all(workers.get(m) for m in models):
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def _stop(procs: list[subprocess.Popen], timeout_s: float = 40.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def up(host: str, port: int, workers: list[tuple[str, str]], ready_timeout_s: float = 600.0) -> int:
    """`workers`: (model, tier) pairs, one worker process each."""
    redis_url = RedisSettings().redis_url
    embedded = None if redis_url else EmbeddedRedis()
    redis_url = redis_url or embedded.url
    key = GatewaySettings().dev_key or "tf-dev-" + secrets.token_urlsafe(16)
    env = {**os.environ, "REDIS_URL": redis_url, "TOKENFLEET_GATEWAY_DEV_KEY": key}
    cli = [sys.executable, "-m", "services.cli"]
    commands = [cli + ["gateway", "--host", host, "--port", str(port)], cli + ["router"]]
    commands += [cli + ["worker", "--model", model, "--tier", tier] for model, tier in workers]
    # CPU workers share the machine: split its cores between them instead of oversubscribing (each torch
    # thread pool spin-waits, and two pools on the same cores slow both and the gateway with them).
    worker_env = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1)
                                                                                   // len(workers)))}
    procs = [subprocess.Popen(command, env=worker_env if "worker" in command else env) for command in commands]
    url = f"http://{host}:{port}"
    try:
        if not wait_ready(url, {model for model, _ in workers}, procs, ready_timeout_s):
            print("tokenfleet: the stack did not become ready; stopping", file=sys.stderr)
            return 1
        print(f"\ntokenfleet is up: {url}/v1  (Redis {redis_url})\n  API key: {key}\n"
              f"  try: curl {url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
              "-H 'Content-Type: application/json' -d '{\"model\": \"auto\", \"messages\": "
              "[{\"role\": \"user\", \"content\": \"Hello!\"}]}'\nCtrl-C stops everything.", flush=True)
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.5)
        print("tokenfleet: a service exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(procs)
        if embedded is not None:
            embedded.close()


def default_workers() -> list[tuple[str, str]]:
    tiers = RouterSettings()
    return [(tiers.small_model, "small"), (tiers.large_model, "large")]
