"""A migrated, empty ledger database per test (PostgreSQL at DATABASE_URL, else SQLite), and an embedded
Redis with the finance API's keys."""

from __future__ import annotations

import asyncio

import pytest

from gateway.auth import register_key
from services.accounting import db
from services.redis_client import EmbeddedRedis, connect


@pytest.fixture
def ledger_engine(new_database):
    engine = db.connect(new_database())
    db.migrate(engine)
    yield engine
    engine.dispose()


async def _register_keys(url: str) -> dict[str, str]:
    """Tenant keys for acme and globex, and an admin key (ops)."""
    redis = connect(url)
    try:
        keys = {name: await register_key(redis, name) for name in ("acme", "globex")}
        return keys | {"ops": await register_key(redis, "ops", admin=True)}
    finally:
        await redis.aclose()


@pytest.fixture(scope="module")
def redis_keys():
    """(URL of an embedded Redis, {name: API key}) for one test module."""
    embedded = EmbeddedRedis()
    yield embedded.url, asyncio.run(_register_keys(embedded.url))
    embedded.close()
