"""A redis-server run on a `KeptRedis` directory as `tokenfleet up` runs it, for the tests of what it keeps."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator

import redis as sync_redis

from services.base.redis_client import KeptRedis


@contextlib.contextmanager
def kept_redis_server(kept: KeptRedis) -> Iterator[sync_redis.Redis]:
    """A client of a redis-server on `kept`'s directory while the block runs; then SHUTDOWN SAVE."""
    server = subprocess.Popen(kept.command(), stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not kept.answers():
            assert time.monotonic() < deadline and server.poll() is None, "the redis-server did not start"
            time.sleep(0.05)
        yield sync_redis.Redis.from_url(kept.url, decode_responses=True, socket_timeout=5)
    finally:
        kept.shutdown()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
