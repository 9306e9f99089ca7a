"""`tokenfleet up`'s supervisor: a service that exits is restarted after a growing backoff, and said so; one that
keeps crashing stops the stack instead of restarting forever."""

from __future__ import annotations

import io
import os
import signal
import sys
import time

from services.supervisor import RestartPolicy, Service, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
CRASHER = [sys.executable, "-c", "raise SystemExit(3)"]


def _check_until(supervisor: Supervisor, done, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        healthy = supervisor.check()
        if done() or not healthy:
            return healthy
        time.sleep(0.05)
    raise AssertionError("the supervisor did not get there in time")


def test_a_service_that_exits_is_restarted_after_its_backoff_and_the_console_says_so():
    out = io.StringIO()
    services = [Service("router", SLEEPER, dict(os.environ)), Service("gateway", SLEEPER, dict(os.environ))]
    supervisor = Supervisor(services, RestartPolicy(backoff_s=0.3), out)
    supervisor.start()
    try:
        router, gateway = services[0].proc, services[1].proc
        router.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert _check_until(supervisor, lambda: services[0].proc is not router)
        assert time.monotonic() - killed_at >= 0.3  # after the backoff, not in a tight loop
        assert services[0].proc.poll() is None and services[1].proc is gateway  # the others left alone
        assert out.getvalue().splitlines() == [
            "tokenfleet: router exited with code -9; restarting it in 0.3 s",
            f"tokenfleet: router restarted (pid {services[0].proc.pid})"]
    finally:
        supervisor.stop(timeout_s=5)
    assert all(proc.poll() is not None for proc in supervisor.procs)


def test_a_service_in_a_crash_loop_stops_the_stack():
    out = io.StringIO()
    supervisor = Supervisor([Service("worker", CRASHER, dict(os.environ))],
                            RestartPolicy(backoff_s=0.01, crash_loop_exits=3, window_s=60), out)
    supervisor.start()
    assert not _check_until(supervisor, lambda: False)
    lines = out.getvalue().splitlines()
    assert [line.split(" with code")[0] for line in lines[:-1:2]] == ["tokenfleet: worker exited"] * 2
    assert lines[-1] == "tokenfleet: worker exited 3 times within 60 s (last exit code 3); stopping the stack"
