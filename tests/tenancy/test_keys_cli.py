"""`tokenfleet keys create / list / revoke` on a real Redis: keys are listed by id (they are stored hashed), a
revoked key no longer authenticates, and the commands find a running `tokenfleet up`'s Redis without REDIS_URL."""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest

from services.base.redis_client import connect
from services.launcher import cli
from services.tenancy.auth import authenticate


def _authenticates(redis_url: str, key: str) -> bool:
    async def check() -> bool:
        redis = connect(redis_url)
        try:
            return await authenticate(redis, f"Bearer {key}") is not None
        finally:
            await redis.aclose()

    return asyncio.run(check())


def _create(name: str, capsys, *flags: str) -> str:
    assert cli.main(["keys", "create", name, *flags]) == 0
    return capsys.readouterr().out.strip()


def test_keys_are_listed_by_id_and_a_revoked_key_is_refused(redis_url, monkeypatch, capsys):
    monkeypatch.setenv("REDIS_URL", redis_url)
    first, second = _create("list-tenant-a", capsys, "--rpm", "7"), _create("list-tenant-b", capsys, "--admin")
    assert cli.main(["keys", "list"]) == 0
    listed = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "rpm 7" in listed["list-tenant-a"] and "admin" in listed["list-tenant-b"]
    assert first not in str(listed) and second not in str(listed)  # only hashes are stored
    first_id = listed["list-tenant-a"].split()[0]
    assert re.fullmatch(r"[0-9a-f]{12}", first_id)

    assert cli.main(["keys", "revoke", first_id]) == 0
    assert "list-tenant-a" in capsys.readouterr().out
    assert not _authenticates(redis_url, first) and _authenticates(redis_url, second)
    assert cli.main(["keys", "revoke", second]) == 0  # by the key itself
    assert not _authenticates(redis_url, second)
    with pytest.raises(SystemExit, match="no keys match"):
        cli.main(["keys", "revoke", first_id])
    with pytest.raises(SystemExit, match="at least 8 hex digits"):
        cli.main(["keys", "revoke", "abc"])


def test_the_keys_commands_find_a_running_local_stack_without_redis_url(redis_url, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("TOKENFLEET_REDIS_URL", raising=False)
    monkeypatch.setenv("TOKENFLEET_CACHE_DIR", str(tmp_path))
    state = tmp_path / "stack.json"
    state.write_text(json.dumps({"pid": os.getpid(), "redis_url": redis_url, "url": "http://127.0.0.1:1"}))
    key = _create("local-stack-tenant", capsys)
    assert _authenticates(redis_url, key)

    state.write_text(json.dumps({"pid": 2 ** 22 + 1, "redis_url": redis_url}))  # a stack that died
    with pytest.raises(SystemExit, match="no `tokenfleet up` is running"):
        cli.main(["keys", "list"])
