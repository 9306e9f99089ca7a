"""`tokenfleet up`'s process supervisor: a service that exits is started again after a backoff, and said so on the
console; the stack stops only when asked (Ctrl-C, SIGTERM) or when one service keeps crashing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Service:
    name: str
    command: list[str]
    env: dict[str, str]
    log: Path | None = None  # its output goes here (appended), else to the console
    proc: subprocess.Popen | None = None
    exits: deque[float] = field(default_factory=deque)  # when it exited, within the crash-loop window
    restart_at: float | None = None  # set while it waits out its backoff


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0  # after the first exit; doubled for each further exit in the window
    max_backoff_s: float = 30.0
    crash_loop_exits: int = 5  # this many exits of one service within `window_s`: stop everything
    window_s: float = 120.0


class Supervisor:
    def __init__(self, services: list[Service], policy: RestartPolicy = RestartPolicy(), out=None):
        self.services, self.policy = services, policy
        self.out = out or sys.stdout

    def start(self) -> None:
        for service in self.services:
            self._spawn(service)

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [s.proc for s in self.services if s.proc is not None]

    def check(self) -> bool:
        """Restarts what exited once its backoff is over; False when a service is in a crash loop."""
        now = time.monotonic()
        for service in self.services:
            if service.restart_at is not None:
                if now >= service.restart_at:
                    self._spawn(service)
                    self._say(f"{service.name} restarted (pid {service.proc.pid})")
                continue
            code = service.proc.poll()
            if code is None:
                continue
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

    def stop(self, timeout_s: float = 40.0) -> None:
        """SIGTERM to every service (each drains as on its own), SIGKILL to what is left after `timeout_s`."""
        procs = [p for p in self.procs if p.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()

    def _spawn(self, service: Service) -> None:
        if service.log is None:
            service.proc = subprocess.Popen(service.command, env=service.env)
        else:
            service.log.parent.mkdir(parents=True, exist_ok=True)
            with service.log.open("a") as log:
                log.write(f"---- tokenfleet: {service.name} starting at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
                log.flush()
                service.proc = subprocess.Popen(service.command, env=service.env, stdout=log,
                                                stderr=subprocess.STDOUT)
        service.restart_at = None

    def _say(self, line: str) -> None:
        print(f"tokenfleet: {line}", file=self.out, flush=True)
