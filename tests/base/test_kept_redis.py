"""`tokenfleet up`'s Redis (`KeptRedis`) in a cache directory too deep for a unix socket's path."""

from __future__ import annotations

from services.base.redis_client import SOCKET_PATH_MAX, KeptRedis
from tests.kept_redis import kept_redis_server


def test_a_kept_redis_in_a_deep_directory_listens_on_a_short_socket_and_keeps_its_data_in_the_directory(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    kept = KeptRedis(deep)
    assert len(str(kept.socket)) <= SOCKET_PATH_MAX and KeptRedis(deep).socket == kept.socket
    with kept_redis_server(kept) as client:
        assert client.ping()
    assert (deep / "tokenfleet.rdb").is_file()
