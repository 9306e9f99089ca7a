"""`tokenfleet up`'s process supervisor: a service that fails is started again after a backoff, and said so on the
console; the stack stops only when asked (Ctrl-C, SIGTERM) or when one service keeps crashing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Deaths systemd's Restart=on-failure counts as clean, beside exit code 0: what a stop (a Ctrl-C to the console's
# process group, `kill`) sends, and a closed terminal or pipe.
CLEAN_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)


@dataclass
class Service:
    name: str
    command: list[str]
    env: dict[str, str]
    log: Path | None = None  # its output goes here (appended), else to the console
    # What the services after it need: they start once this holds, and stop before it is stopped.
    ready: Callable[[], bool] | None = None
    stop: Callable[[], None] | None = None  # how to ask it to stop, instead of a SIGTERM
    own_session: bool = False  # out of the console's process group: a Ctrl-C reaches it only through `stop`
    proc: subprocess.Popen | None = None
    exits: deque[float] = field(default_factory=deque)  # when it failed, within the crash-loop window
    restart_at: float | None = None  # set while it waits out its backoff
    stopped: bool = False  # stopped by the supervisor, or exited cleanly: left stopped

    def ask_to_stop(self) -> None:
        self.stopped = True
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.stop is not None:
            self.stop()
        else:
            self.proc.send_signal(signal.SIGTERM)


class StartFailed(RuntimeError):
    """A service others need exited, or was not ready in time, while the stack started."""


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0  # after the first failure; doubled for each further failure in the window
    max_backoff_s: float = 30.0
    crash_loop_exits: int = 5  # this many failures of one service within `window_s`: stop everything
    window_s: float = 120.0


class Supervisor:
    def __init__(self, services: list[Service], policy: RestartPolicy = RestartPolicy(), out=None):
        self.services, self.policy = services, policy
        self.out = out or sys.stdout

    def start(self, ready_timeout_s: float = 120.0) -> None:
        """Starts the services in order, each one with `ready` waited for before the next."""
        for service in self.services:
            self._spawn(service)
            if service.ready is not None:
                self._wait_ready(service, ready_timeout_s)

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [s.proc for s in self.services if s.proc is not None]

    def check(self) -> bool:
        """Restarts what failed once its backoff is over; False when a service is in a crash loop."""
        now = time.monotonic()
        for service in self.services:
            if service.stopped:
                continue
            if service.restart_at is not None:
                if now >= service.restart_at:
                    self._spawn(service)
                    self._say(f"{service.name} restarted (pid {service.proc.pid})")
                continue
            code = service.proc.poll()
            if code is None:
                continue
            if _is_clean(code):  # systemd's Restart=on-failure: e.g. the group's Ctrl-C reached it first
                service.stopped = True
                self._say(f"{service.name} exited cleanly ({_describe(code)}); leaving it stopped")
            elif not self._restart_later(service, code, now):
                return False
        return True

    def stop(self, timeout_s: float = 40.0) -> None:
        """Asks every service to stop (each drains as on its own SIGTERM), the last started first, those others
        need after the others; SIGKILL to what is left after `timeout_s` of its turn."""
        for tier in reversed(self._tiers()):
            for service in tier:
                service.ask_to_stop()
            deadline = time.monotonic() + timeout_s
            for proc in [s.proc for s in tier if s.proc is not None]:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def _tiers(self) -> list[list[Service]]:
        """The services in start order, split after each one the rest need."""
        tiers = [[]]
        for service in self.services:
            tiers[-1].append(service)
            if service.ready is not None:
                tiers.append([])
        return [tier for tier in tiers if tier]

    def _restart_later(self, service: Service, code: int, now: float) -> bool:
        """Schedules the restart of a failed service; False if it is in a crash loop."""
        while service.exits and service.exits[0] < now - self.policy.window_s:
            service.exits.popleft()
        service.exits.append(now)
        if len(service.exits) >= self.policy.crash_loop_exits:
            where = f"; its log: {service.log}" if service.log is not None else ""
            self._say(f"{service.name} exited {len(service.exits)} times within {self.policy.window_s:.0f} s "
                      f"(last exit code {code}); stopping the stack{where}")
            return False
        delay = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** (len(service.exits) - 1))
        service.restart_at = now + delay
        where = f" (its log: {service.log})" if service.log is not None else ""
        self._say(f"{service.name} exited with code {code}; restarting it in {delay:.3g} s{where}")
        return True

    def _wait_ready(self, service: Service, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not service.ready():
            where = f"; its log: {service.log}" if service.log is not None else ""
            if (code := service.proc.poll()) is not None:
                raise StartFailed(f"{service.name} exited with code {code} while starting{where}")
            if time.monotonic() > deadline:
                raise StartFailed(f"{service.name} was not ready within {timeout_s:.0f} s{where}")
            time.sleep(0.05)

    def _spawn(self, service: Service) -> None:
        if service.log is None:
            service.proc = subprocess.Popen(service.command, env=service.env, start_new_session=service.own_session)
        else:
            service.log.parent.mkdir(parents=True, exist_ok=True)
            with service.log.open("a") as log:
                log.write(f"---- tokenfleet: {service.name} starting at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
                log.flush()
                service.proc = subprocess.Popen(service.command, env=service.env, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=service.own_session)
        service.restart_at = None

    def _say(self, line: str) -> None:
        print(f"tokenfleet: {line}", file=self.out, flush=True)


def _is_clean(code: int) -> bool:
    return code == 0 or code < 0 and -code in CLEAN_SIGNALS


def _describe(code: int) -> str:
    return signal.Signals(-code).name if code < 0 else f"code {code}"
