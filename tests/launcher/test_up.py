"""`tokenfleet up`: the README's main command brings the whole stack up and takes it down on Ctrl-C, or on
SIGTERM from a service manager, leaving no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import openai
import psutil
import pytest

from services.launcher.stack import LOCAL_MAX_TOKENS
from services.text import builtin_models
from tests.stack import _free_port


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The stacks' own (ledger, dev key), but the native kernels the rest of the suite built: building them
    again took 1-1.5 min of the suite (test_native_kernels_build_on_this_cpu checks that they build)."""
    cache = tmp_path_factory.mktemp("cache")
    kernels = builtin_models.cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    return cache


def _env_without_redis() -> dict[str, str]:
    """This environment less REDIS_URL: `tokenfleet up` then embeds its own Redis."""
    return {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TOKENFLEET_REDIS_URL")}


@pytest.fixture
def up_process(cache_dir):
    port = _free_port()
    env = _env_without_redis()
    env["TOKENFLEET_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "up", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, text=True)
    yield proc, port, cache_dir
    if proc.poll() is None:  # the test failed before the stack stopped: stop it as Ctrl-C would
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:  # it hangs: its services (not its embedded Redis) go down with it
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()


def _printed_key(proc, console: list[str] | None = None) -> str:
    """The API key `tokenfleet up` prints once the stack is ready (what it printed before, into `console`)."""
    for line in proc.stdout:
        if match := re.search(r"API key: +(\S+)", line):
            return match.group(1)
        if console is not None:
            console.append(line)
    raise AssertionError("tokenfleet up printed no key")


def test_up_serves_the_trained_default_model_on_embedded_redis_and_stops_everything_on_ctrl_c(up_process):
    proc, port, cache = up_process
    console = []
    key = _printed_key(proc, console)
    assert (cache / "dev-key").read_text().strip() == key  # where the README's examples read it
    # its own lines while it starts (what starts, then what it waits for), then the banner; each service's
    # output in its own file
    said = [line for line in console if line.strip()]
    starting = said[:said.index("tokenfleet is up\n")]
    assert starting and all(line.startswith("tokenfleet: ") for line in starting), said
    assert "Celery" in said[0] and str(cache / "logs") in said[0]
    logs = {path.name: path.read_text() for path in (cache / "logs").iterdir()}
    assert {"gateway.log", "router.log", "accounting.log", "celery.log"} <= set(logs)
    assert logs["gateway.log"].startswith("---- tokenfleet: gateway starting at ")
    assert "tokenfleet-accounting" in logs["celery.log"]  # Celery's banner, off the console
    children = psutil.Process(proc.pid).children(recursive=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"smollm2-135m-instruct", "auto"}
    assert models["smollm2-135m-instruct"].model_extra["tier"] == "small,large"  # one model serves both tiers
    reply = client.chat.completions.create(model="auto", temperature=0, max_tokens=16,
                                           messages=[{"role": "user", "content": "What is the capital of Germany?"}])
    assert "Berlin" in reply.choices[0].message.content and reply.model == "smollm2-135m-instruct"
    unbounded = client.chat.completions.create(model="auto", temperature=0, extra_body={"ignore_eos": True},
                                               messages=[{"role": "user", "content": "Tell me a long story."}])
    assert unbounded.usage.completion_tokens == LOCAL_MAX_TOKENS  # the local stack's default, not 8k tokens

    _stops_cleanly(proc, children, signal.SIGINT)


def _stops_cleanly(proc, children: list[psutil.Process], stop: signal.Signals) -> None:
    proc.send_signal(stop)
    assert proc.wait(60) == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_up_restarts_a_killed_service_keeps_serving_and_stops_everything_on_sigterm(up_process):
    proc, port, cache = up_process
    key = _printed_key(proc)
    [router] = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.cmdline()[-1:] == ["router"]]
    router.kill()
    said = []
    for line in proc.stdout:
        if line.startswith("tokenfleet: "):
            said.append(line.strip())
        if line.startswith("tokenfleet: router restarted"):
            break
    assert said[0].startswith("tokenfleet: router exited with code -9; restarting it in 1 s (its log: "), said
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=120)
    reply = client.chat.completions.create(model="auto", temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "What is the capital of Germany?"}])
    assert reply.choices[0].message.content  # routed by the new router

    # `tokenfleet keys` finds the running stack's embedded Redis by itself
    env = _env_without_redis()
    created = subprocess.run([sys.executable, "-m", "services.launcher.cli", "keys", "create", "up-tenant"], text=True,
                             capture_output=True, timeout=60, env={**env, "TOKENFLEET_CACHE_DIR": str(cache)})
    assert created.returncode == 0, created.stderr
    tenant = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=created.stdout.strip(), timeout=120)
    assert tenant.models.list().data

    _stops_cleanly(proc, psutil.Process(proc.pid).children(recursive=True), signal.SIGTERM)  # as a service manager
    assert not (cache / "stack.json").exists()


@pytest.mark.parametrize("taken", ["TOKENFLEET_GATEWAY_PORT", "TOKENFLEET_ACCOUNTING_PORT"])
def test_up_refuses_a_port_in_use_naming_it_and_the_setting_that_moves_it(cache_dir, taken):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        ports = {"TOKENFLEET_GATEWAY_PORT": str(_free_port()), "TOKENFLEET_ACCOUNTING_PORT": str(_free_port()),
                 taken: str(busy)}  # the settings reach `tokenfleet up`, with no --port
        env = _env_without_redis()
        proc = subprocess.run([sys.executable, "-m", "services.launcher.cli", "up"], capture_output=True, text=True,
                              timeout=120, env={**env, "TOKENFLEET_CACHE_DIR": str(cache_dir), **ports})
    assert proc.returncode == 1 and "tokenfleet is up" not in proc.stdout
    assert f"port {busy} on 127.0.0.1" in proc.stderr and taken in proc.stderr, proc.stderr


def test_up_refuses_to_start_a_second_stack_from_the_same_cache_directory(tmp_path):
    (tmp_path / "stack.json").write_text(json.dumps({"pid": os.getpid(), "url": "http://127.0.0.1:9"}))
    env = _env_without_redis()
    proc = subprocess.run([sys.executable, "-m", "services.launcher.cli", "up", "--port", str(_free_port())], text=True,
                          capture_output=True, timeout=120, env={**env, "TOKENFLEET_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 1 and "a stack is already up from" in proc.stderr, proc.stderr
    assert not (tmp_path / "redis").exists()  # it touched nothing of the running one's
