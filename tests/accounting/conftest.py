"""A migrated, empty ledger database per test (PostgreSQL at DATABASE_URL, else SQLite), an embedded Redis with
the finance API's keys, and `ledger_row`, a ledger row to write."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from decimal import Decimal

import pytest

from services.accounting import db
from services.base.redis_client import EmbeddedRedis, connect
from services.tenancy.auth import register_key


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


def ledger_row(finished_at: datetime, tenant: str = "acme", model: str = "m1", status: str = "ok",
               ttft: float = 0.2, tpot: float = 0.02, tokens: tuple[int, int, int] = (100, 0, 10),
               costs: tuple[str, str] = ("0.001", "0.0005"), met: bool = True,
               drafts: tuple[int, int] = (0, 0)) -> dict:
    """A ledger row as `ledger.record` takes it; a task meets its SLA only when it finished ok."""
    prompt, cached, completion = tokens
    return {"request_id": uuid.uuid4().hex, "tenant": tenant, "api_key_id": None, "model": model, "tier": None,
            "worker_id": None, "worker_class": None, "routing_reason": None, "cache_result": "none",
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion, "queue_s": 0.0,
            "draft_tokens": drafts[0], "accepted_draft_tokens": drafts[1],
            "ttft_s": ttft, "tpot_s": tpot, "e2e_s": 1.0, "gpu_seconds": 0.1, "list_cost_usd": Decimal(costs[0]),
            "measured_cost_usd": Decimal(costs[1]), "sla_class": "interactive", "sla_met": met and status == "ok",
            "status": status, "enqueued_at": finished_at - timedelta(seconds=1), "finished_at": finished_at}
