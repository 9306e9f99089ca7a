"""`tokenfleet accounting`: the ledger consumer (with budget settlement) and the finance API beside it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket

import uvicorn

from services.accounting import db
from services.accounting.api import create_finance_app
from services.accounting.consumer import LedgerConsumer
from services.accounting.metrics import LedgerMetrics
from services.base.gc_tuning import started
from services.base.redis_client import connect
from services.base.settings import AccountingSettings, StreamSettings
from services.tenancy import budgets
from services.tenancy.prices import PriceTable
from services.tenancy.sla import SlaPolicy


async def serve(settings: AccountingSettings, redis_url: str) -> None:
    engine = db.connect(settings.ledger_url())
    await asyncio.to_thread(db.migrate, engine)
    redis = connect(redis_url)
    metrics = LedgerMetrics()
    consumer = LedgerConsumer(redis, engine, PriceTable.load(settings.prices_path), SlaPolicy.load(settings.sla_path),
                              f"{socket.gethostname()}-{os.getpid()}", StreamSettings(),
                              settle=functools.partial(budgets.settle, redis), metrics=metrics)
    app = create_finance_app(engine, redis, metrics.registry)
    api = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                        access_log=False))
    serving = asyncio.create_task(api.serve())
    stop = started()
    # On SIGTERM uvicorn's own handler stops the API first, then re-raises the signal for `started()`'s: the
    # consumer stops after its batch. If the API ends for any other reason, the consumer stops with it.
    serving.add_done_callback(lambda _: stop.set())
    try:
        await consumer.run(stop)
    finally:
        api.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await redis.aclose()
        engine.dispose()
