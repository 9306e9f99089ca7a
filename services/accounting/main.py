"""`tokenfleet accounting`: the ledger consumer (and, with it, budget settlement)."""

from __future__ import annotations

import asyncio
import os
import socket

from services.accounting import db
from services.accounting.consumer import LedgerConsumer
from services.accounting.prices import PriceTable
from services.accounting.sla import SlaPolicy
from services.gc_tuning import started
from services.redis_client import connect
from services.settings import AccountingSettings, StreamSettings


async def serve(settings: AccountingSettings, redis_url: str) -> None:
    engine = db.connect(settings.ledger_url())
    await asyncio.to_thread(db.migrate, engine)
    redis = connect(redis_url)
    consumer = LedgerConsumer(redis, engine, PriceTable.load(settings.prices_path), SlaPolicy.load(settings.sla_path),
                              f"{socket.gethostname()}-{os.getpid()}", StreamSettings())
    stop = started()
    try:
        await consumer.run(stop)
    finally:
        await redis.aclose()
        engine.dispose()
