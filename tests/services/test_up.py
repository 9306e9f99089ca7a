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

from tests.services.conftest import _free_port


@pytest.fixture
def up_process(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TOKENFLEET_REDIS_URL")}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, text=True)
    yield proc, port
    if proc.poll() is None:
        proc.kill()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_up_serves_both_built_in_models_on_embedded_redis_and_stops_everything_cleanly(up_process, stop):
    proc, port = up_process
    key = None
    for line in proc.stdout:
        if match := re.search(r"API key: (\S+)", line):
            key = match.group(1)
            break
    assert key, "tokenfleet up printed no key"
    children = psutil.Process(proc.pid).children(recursive=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
    assert {m.id for m in client.models.list()} >= {"tokenfleet-small", "tokenfleet-large", "auto"}
    for model in ("tokenfleet-small", "tokenfleet-large"):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4)
        assert reply.usage.completion_tokens == 4 and reply.model == model

    proc.send_signal(stop)
    assert proc.wait(60) == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
