"""`tokenfleet accounting`: the ledger consumer (and, with it, budget settlement)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

from services.accounting import db
from services.accounting.consumer import LedgerConsumer
from services.accounting.prices import PriceTable
from services.accounting.sla import SlaPolicy
from services.gc_tuning import freeze_startup_objects
from services.redis_client import connect
from services.settings import AccountingSettings, StreamSettings


async def serve(settings: AccountingSettings, redis_url: str) -> None:
    engine = db.connect(settings.ledger_url())
    await asyncio.to_thread(db.migrate, engine)
    redis = connect(redis_url)
    consumer = LedgerConsumer(redis, engine, PriceTable.load(settings.prices_path), SlaPolicy.load(settings.sla_path),
                              f"{socket.gethostname()}-{os.getpid()}", StreamSettings())
    freeze_startup_objects()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await consumer.run(stop)
    finally:
        await redis.aclose()
        engine.dispose()
