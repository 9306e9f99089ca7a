"""`tokenfleet up`'s supervisor: a service that fails is restarted after a growing backoff, and said so; one that
ends cleanly (systemd's Restart=on-failure) or that the supervisor stops is left stopped; one that keeps crashing
stops the stack instead of restarting forever; one the others need starts before them and stops after them."""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from services.launcher.supervisor import RestartPolicy, Service, StartFailed, Supervisor

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


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", "import os, signal, sys, time\n" + code]


# systemd's Restart=on-failure: a clean end (exit code 0, or the SIGINT / SIGTERM a stop of the process group
# sends) leaves a service stopped; a failure restarts it.
@pytest.mark.parametrize(("code", "said"), [
    ("sys.exit(0)", "router exited cleanly (code 0); leaving it stopped"),
    ("os.kill(os.getpid(), signal.SIGTERM)", "router exited cleanly (SIGTERM); leaving it stopped"),
    ("sys.exit(3)", "router exited with code 3; restarting it in 0.01 s"),
], ids=["exit-0", "sigterm", "exit-3"])
def test_only_a_service_that_fails_is_restarted(code, said):
    out = io.StringIO()
    service = Service("router", _python(code), dict(os.environ))
    supervisor = Supervisor([service], RestartPolicy(backoff_s=0.01), out)
    supervisor.start()
    first = service.proc
    try:
        assert _check_until(supervisor, lambda: out.getvalue())
        time.sleep(0.1)  # past the backoff: a restart would be due
        supervisor.check()
        restarted = service.proc is not first
        assert out.getvalue().splitlines()[0] == f"tokenfleet: {said}"
        assert restarted == ("restarting" in said), out.getvalue()
    finally:
        supervisor.stop(timeout_s=5)


def _on_sigterm(action: str, flag: Path, first: str = "") -> list[str]:
    """A service that does `action` on SIGTERM, and creates `flag` once it handles it (a `ready` for the test)."""
    return _python(f"{first}\nsignal.signal(signal.SIGTERM, lambda *_: ({action}))\n"
                   f"open({str(flag)!r}, 'w').close()\ntime.sleep(600)")


def test_a_service_the_supervisor_stops_is_not_restarted_even_if_it_fails_as_it_stops(tmp_path):
    out, flag = io.StringIO(), tmp_path / "handled"
    service = Service("worker", _on_sigterm("sys.exit(1)", flag), dict(os.environ), ready=flag.exists)
    supervisor = Supervisor([service], RestartPolicy(backoff_s=0.01), out)
    supervisor.start()
    first = service.proc
    supervisor.stop(timeout_s=5)
    assert first.returncode == 1
    time.sleep(0.05)
    assert supervisor.check() and service.proc is first and out.getvalue() == ""


def test_a_service_the_others_need_starts_before_them_and_stops_after_them(tmp_path):
    needed_flag, user_flag = tmp_path / "redis", tmp_path / "router"
    needed = Service("redis", _python(f"time.sleep(0.3)\nopen({str(needed_flag)!r}, 'w').close()\ntime.sleep(600)"),
                     dict(os.environ), ready=needed_flag.exists)
    # the router fails unless Redis was ready when it started, and drains a moment on SIGTERM
    user = Service("router", _on_sigterm("time.sleep(0.3), sys.exit(0)", user_flag,
                                         first=f"if not os.path.exists({str(needed_flag)!r}): sys.exit(2)"),
                   dict(os.environ), ready=user_flag.exists)
    asked = []
    needed.stop = lambda: (asked.append(user.proc.poll()), needed.proc.send_signal(signal.SIGTERM))
    supervisor = Supervisor([needed, user], out=io.StringIO())
    supervisor.start()
    assert user.proc.poll() is None
    supervisor.stop(timeout_s=5)
    assert asked == [0]  # the router had drained when Redis was asked to stop
    assert needed.proc.returncode == -signal.SIGTERM


def test_a_needed_service_that_exits_while_starting_fails_the_start():
    needed = Service("redis", _python("sys.exit(1)"), dict(os.environ), ready=lambda: False)
    later = Service("router", SLEEPER, dict(os.environ))
    supervisor = Supervisor([needed, later], out=io.StringIO())
    with pytest.raises(StartFailed, match="redis exited with code 1 while starting"):
        supervisor.start()
    assert later.proc is None  # never started
