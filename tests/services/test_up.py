"""`tokenfleet up`: the README's main command brings the whole stack up and takes it down on Ctrl-C, or on
SIGTERM from a service manager, leaving no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import openai
import psutil
import pytest

from gpu_worker.engine import builtin_models
from services.stack import LOCAL_MAX_TOKENS
from tests.services.conftest import _free_port


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The stacks' own (ledger, dev key), but the native kernels the rest of the suite built: building them
    again took 1-1.5 min of the suite (test_native_kernels_build_on_this_cpu checks that they build)."""
    cache = tmp_path_factory.mktemp("cache")
    kernels = builtin_models.cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    return cache


@pytest.fixture
def up_process(cache_dir):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TOKENFLEET_REDIS_URL")}
    env["TOKENFLEET_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, text=True)
    yield proc, port, cache_dir
    if proc.poll() is None:  # the test failed before the stack stopped: take its services down with it
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()


def _printed_key(proc) -> str:
    """The API key `tokenfleet up` prints once the stack is ready."""
    for line in proc.stdout:
        if match := re.search(r"API key: (\S+)", line):
            return match.group(1)
    raise AssertionError("tokenfleet up printed no key")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_up_serves_the_trained_default_model_on_embedded_redis_and_stops_everything_cleanly(up_process, stop):
    proc, port, cache = up_process
    key = _printed_key(proc)
    assert (cache / "dev-key").read_text().strip() == key  # where the README's examples read it
    children = psutil.Process(proc.pid).children(recursive=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"smollm2-135m-instruct", "auto"}
    assert models["smollm2-135m-instruct"].model_extra["tier"] == "small,large"  # one model serves both tiers
    reply = client.chat.completions.create(model="auto", temperature=0, max_tokens=16,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content and reply.model == "smollm2-135m-instruct"
    unbounded = client.chat.completions.create(model="auto", temperature=0, extra_body={"ignore_eos": True},
                                               messages=[{"role": "user", "content": "Tell me a long story."}])
    assert unbounded.usage.completion_tokens == LOCAL_MAX_TOKENS  # the local stack's default, not 8k tokens

    proc.send_signal(stop)
    assert proc.wait(60) == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_up_restarts_a_killed_service_and_keeps_serving(up_process):
    proc, port, _ = up_process
    key = _printed_key(proc)
    [router] = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.cmdline()[-1:] == ["router"]]
    router.kill()
    said = []
    for line in proc.stdout:
        if line.startswith("tokenfleet: "):
            said.append(line.strip())
        if line.startswith("tokenfleet: router restarted"):
            break
    assert said[0] == "tokenfleet: router exited with code -9; restarting it in 1 s", said
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=120)
    reply = client.chat.completions.create(model="auto", temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content  # routed by the new router
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
