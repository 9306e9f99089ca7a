"""`tokenfleet up`: the whole stack as local processes on embedded defaults (Redis one of them), each restarted if
it fails (services/launcher/supervisor.py), all stopped cleanly on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.base.redis_client import KeptRedis
from services.base.settings import GatewaySettings, RedisSettings, RouterSettings, WorkerSettings, cache_dir
from services.launcher import first_start
from services.launcher.supervisor import Service, StartFailed, Supervisor

# The local stack's max_tokens for requests that set none: a reply, not the rest of an 8k context.
LOCAL_MAX_TOKENS = 256
STATE_FILE = "stack.json"  # in the cache directory while `tokenfleet up` runs
PROGRESS_EVERY_S = 15.0  # how often `tokenfleet up` says what it still waits for
SOCKET_PATH_MAX = 107  # bytes of a unix socket's path (Linux's sun_path, less its terminating NUL)


def waiting_for(url: str, models: set[str]) -> list[str]:
    """What the stack whose gateway is at `url` still lacks: the gateway itself, or a live worker of a model."""
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
            workers = json.loads(response.read())["workers"]
    except urllib.error.HTTPError as unready:  # a 503 names what is missing
        try:
            workers = json.loads(unready.read()).get("workers", {}) if unready.code == 503 else None
        except (ValueError, OSError, AttributeError):
            workers = None
        if not isinstance(workers, dict):
            return ["the gateway"]
    except OSError:
        return ["the gateway"]
    return [f"a worker of {m}" for m in sorted(models) if not workers.get(m)]


def is_ready(url: str, models: set[str]) -> bool:
    """The gateway at `url` answers and reports a live worker for each of `models`."""
    return not waiting_for(url, models)


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
    embedded: KeptRedis | None  # its own Redis, one of the supervisor's services, when REDIS_URL is unset
    env: dict[str, str]  # what every service was started with
    scratch: tempfile.TemporaryDirectory | None  # the embedded Redis's directory, when it keeps nothing

    @property
    def procs(self) -> list[subprocess.Popen]:
        return self.supervisor.procs

    def stop(self) -> None:
        try:
            self.supervisor.stop()
        finally:
            if self.scratch is not None:
                self.scratch.cleanup()


def local_dev_key() -> str:
    """The local stack's API key, made once and kept in the cache directory (`cat ~/.cache/tokenfleet/dev-key`),
    so scripts and the README's examples find it across restarts."""
    path = cache_dir() / "dev-key"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, "tf-dev-" + secrets.token_urlsafe(16) + "\n", private=True)
    return path.read_text().strip()


def start(host: str, port: int, workers: list[tuple[str, str]], env: dict[str, str] | None = None,
          worker_env: dict[str, str] | None = None, log_dir: Path | None = None,
          redis_dir: Path | None = None) -> LocalStack:
    """Gateway, router, accounting, its Celery worker and a worker process per (model, tier), on REDIS_URL or an
    embedded Redis, started first and supervised like them (kept in `redis_dir`, else in a temporary directory).
    `env` goes to every process, `worker_env` to the workers on top of it; each process's output goes to its
    own file in `log_dir` when given."""
    redis_url = RedisSettings().redis_url
    scratch = None if redis_url or redis_dir else tempfile.TemporaryDirectory(prefix="tokenfleet-redis-")
    embedded = None if redis_url else embedded_redis(Path(redis_dir or scratch.name))
    redis_url = redis_url or embedded.url
    key = GatewaySettings().dev_key or local_dev_key()
    env = {"TOKENFLEET_ACCOUNTING_PORT": str(port + 1), "TOKENFLEET_WORKER_DEFAULT_MAX_TOKENS": str(LOCAL_MAX_TOKENS),
           **os.environ, **(env or {}), "REDIS_URL": redis_url, "TOKENFLEET_GATEWAY_DEV_KEY": key}
    cli = [sys.executable, "-m", "services.launcher.cli"]
    # CPU workers share the machine: split its cores between them instead of oversubscribing (each torch
    # thread pool spin-waits, and two pools on the same cores slow both and the gateway with them).
    threads = env.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // len(workers)))
    workers_env = {**env, "OMP_NUM_THREADS": threads, **(worker_env or {})}
    services = [_redis_service(embedded)] if embedded else []
    services += [Service("gateway", cli + ["gateway", "--host", host, "--port", str(port)], env),
                 Service("router", cli + ["router"], env), Service("accounting", cli + ["accounting"], env),
                 Service("celery", cli + ["celery"], env)]
    services += [Service(f"worker {model} ({tier})", cli + ["worker", "--model", model, "--tier", tier], workers_env)
                 for model, tier in workers]
    for service in services if log_dir is not None else ():
        service.log = log_dir / (re.sub(r"[^\w.]+", "-", service.name).strip("-") + ".log")
    supervisor = Supervisor(services)
    try:
        supervisor.start()
    except BaseException:  # e.g. Ctrl-C while it starts: nothing it started is left behind
        LocalStack("", key, redis_url, supervisor, embedded, env, scratch).stop()
        raise
    return LocalStack(f"http://{host}:{port}", key, redis_url, supervisor, embedded, env, scratch)


def embedded_redis(directory: Path) -> KeptRedis:
    """The stack's own Redis, kept in `directory`, ready to start. One still answering there outlived a stack that
    was killed (no stack runs from this directory): it is stopped, saving, so that two servers never write the same
    append-only file."""
    redis = KeptRedis(directory)
    if len(bytes(redis.socket)) > SOCKET_PATH_MAX:  # the server would listen on a cut path, and never answer
        raise StartFailed(f"the path of Redis's socket, {redis.socket}, is too long for a unix socket; set "
                          "TOKENFLEET_CACHE_DIR to a shorter directory")
    directory.mkdir(parents=True, exist_ok=True)
    if redis.answers():
        redis.shutdown()
    return redis


def _redis_service(redis: KeptRedis) -> Service:
    # Out of the console's process group: a Ctrl-C reaches it through the supervisor, once the services that
    # need it to drain (handing back their work) have stopped.
    return Service("redis", redis.command(), dict(os.environ), ready=redis.answers, stop=redis.shutdown,
                   own_session=True)


def _interrupt(signum, frame) -> None:
    """The first Ctrl-C or SIGTERM stops the stack; later ones are ignored, so that the stop runs to its end (the
    supervisor bounds it) and Redis, stopped last, is not left running."""
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, signal.SIG_IGN)
    raise KeyboardInterrupt


def port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to serve on
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def up(host: str, port: int, workers: list[tuple[str, str]], ready_timeout_s: float = 600.0,
       console_logs: bool = False) -> int:
    """`workers`: (model, tier) pairs, one worker process each. A service that fails is restarted; Ctrl-C or
    SIGTERM (a service manager, `kill`) stops them all, each draining as on its own SIGTERM. Each service's
    output goes to its own file in the cache directory's `logs/`, or to the console with `console_logs`."""
    finance_port = int(os.environ.get("TOKENFLEET_ACCOUNTING_PORT") or port + 1)
    if refusal := _cannot_start(host, port, finance_port):
        print(f"tokenfleet: {refusal}", file=sys.stderr)
        return 1
    for signum in (signal.SIGINT, signal.SIGTERM):  # whatever it inherited: a script may have started it ignoring
        signal.signal(signum, _interrupt)
    log_dir = None if console_logs else cache_dir() / "logs"
    models = sorted({model for model, _ in workers})
    try:
        first_start.prepare(models, WorkerSettings())
        print(f"tokenfleet: starting the gateway, router, accounting, Celery and {len(workers)} worker(s) "
              f"({', '.join(models)})" + (f"; logs in {log_dir}" if log_dir else ""), flush=True)
        stack = start(host, port, workers, env={"TOKENFLEET_ACCOUNTING_PORT": str(finance_port)}, log_dir=log_dir,
                      redis_dir=cache_dir() / "redis")
    except KeyboardInterrupt:
        return 0
    except StartFailed as failed:
        print(f"tokenfleet: {failed}", file=sys.stderr)
        return 1
    state = cache_dir() / STATE_FILE
    try:
        _write_atomically(state, json.dumps({"pid": os.getpid(), "url": stack.url, "redis_url": stack.redis_url,
                                             "finance_url": f"http://{host}:{finance_port}"}))
        if not _until_ready(stack, set(models), ready_timeout_s):
            return 1
        print(banner(stack, host, finance_port, models, log_dir), flush=True)
        while stack.supervisor.check():
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        state.unlink(missing_ok=True)
        stack.stop()


def _until_ready(stack: LocalStack, models: set[str], timeout_s: float) -> bool:
    """Supervises the stack until it is ready, saying what it still waits for now and then; False if it is not
    ready within `timeout_s` or a service is in a crash loop."""
    started = said = time.monotonic()
    while missing := waiting_for(stack.url, models):
        if not stack.supervisor.check():
            return False
        now = time.monotonic()
        if now > started + timeout_s:
            print("tokenfleet: the stack did not become ready; stopping", file=sys.stderr)
            return False
        if now > said + PROGRESS_EVERY_S:
            print(f"tokenfleet: starting ({now - started:.0f} s): waiting for {', '.join(missing)}", flush=True)
            said = now
        time.sleep(0.5)
    return True


def _cannot_start(host: str, port: int, finance_port: int) -> str | None:
    if other := running_stack():  # it would share, then stop, that stack's embedded Redis
        return (f"a stack is already up from {cache_dir()} ({other.get('url')}, pid {other['pid']}); stop it first, "
                "or run another with its own TOKENFLEET_CACHE_DIR")
    for number, what, setting in ((port, "the gateway", "--port or TOKENFLEET_GATEWAY_PORT"),
                                  (finance_port, "the finance API", "TOKENFLEET_ACCOUNTING_PORT")):
        if not port_free(host, number):  # else the banner would point at whatever holds it
            return (f"port {number} on {host}, for {what}, is in use (another `tokenfleet up`, or another server); "
                    f"choose a free one with {setting}")
    return None


def running_stack() -> dict | None:
    """The `tokenfleet up` running from this cache directory (its URLs and Redis), if any: how `tokenfleet keys`
    finds the embedded Redis without being told."""
    try:
        state = json.loads((cache_dir() / STATE_FILE).read_text())
        os.kill(state["pid"], 0)
    except (OSError, ValueError, KeyError):  # none, or it died without removing the file
        return None
    return state


def _write_atomically(path: Path, text: str, private: bool = False) -> None:
    """A reader sees the old file or the new one, never half of it (`private`: readable by its owner only)."""
    staging = path.with_suffix(f".{os.getpid()}")
    staging.write_text(text)
    if private:
        staging.chmod(0o600)
    staging.replace(path)


def banner(stack: LocalStack, host: str, finance_port: int, models: list[str], log_dir: Path | None) -> str:
    finance = f"http://{host}:{finance_port}"
    redis = (f"{stack.redis_url} (embedded, kept in {stack.embedded.directory})" if stack.embedded is not None
             else stack.redis_url)
    return "\n".join([
        "",
        "tokenfleet is up",
        f"  API:          {stack.url}/v1  (models: {', '.join(models)}, auto)",
        f"  API key:      {stack.api_key}  (kept in {cache_dir() / 'dev-key'} unless TOKENFLEET_GATEWAY_DEV_KEY "
        "is set)",
        f"  dashboard:    {finance}/dashboard#key={stack.api_key}",
        "                (this key's own usage; `tokenfleet keys create NAME --admin` makes a key that sees every "
        "tenant)",
        f"  finance API:  {finance}/v1/ledger",
        f"  Redis:        {redis}",
        f"  logs:         {log_dir}/<service>.log" if log_dir else "  logs:         on this console",
        f"  try: curl {stack.url}/v1/chat/completions -H 'Authorization: Bearer {stack.api_key}' "
        "-H 'Content-Type: application/json' -d '{\"model\": \"auto\", \"max_tokens\": 64, \"messages\": "
        "[{\"role\": \"user\", \"content\": \"What is the capital of Germany?\"}]}'",
        "Ctrl-C stops everything.",
    ])


def default_workers() -> list[tuple[str, str]]:
    """One worker per tier's model; one worker for both when they name the same model (the default)."""
    tiers = RouterSettings()
    if tiers.small_model == tiers.large_model:
        return [(tiers.small_model, "small,large")]
    return [(tiers.small_model, "small"), (tiers.large_model, "large")]
