"""A service that does not stop says where it is stuck: SIGUSR2 prints each asyncio task's stack (SIGUSR1 each
thread's), as `services.base.gc_tuning.started` installs them in every service."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

PROGRAM = """
import asyncio
from services.base.gc_tuning import started

async def waiting_for_a_reply_that_never_comes(stop):
    await stop.wait()

async def main():
    stop = started()
    print("ready", flush=True)
    await waiting_for_a_reply_that_never_comes(stop)

asyncio.run(main())
"""


def test_sigusr2_prints_what_each_task_awaits_and_sigterm_still_stops_the_service():
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR2)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "waiting_for_a_reply_that_never_comes" in stderr
