"""`tokenfleet gateway`: the FastAPI app under uvicorn."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from gateway.batches import celery_submitter
from gateway.delivery_journal import open_journal
from services.accounting.prices import PriceTable
from services.accounting.sla import SlaPolicy
from services.asyncio_tasks import keep_cancellations
from services.gc_tuning import freeze_startup_objects
from services.redis_client import connect
from services.settings import AccountingSettings, CacheSettings, GatewaySettings, RouterSettings, StreamSettings


async def serve(settings: GatewaySettings, redis_url: str) -> None:
    redis = connect(redis_url)
    journal = open_journal(settings.journal_path())
    accounting = AccountingSettings()  # budgets are estimated and SLA classes named as the ledger prices them
    app = create_app(redis, settings, RouterSettings(), StreamSettings(), CacheSettings().default_mode,
                     prices=PriceTable.load(accounting.prices_path), sla=SlaPolicy.load(accounting.sla_path),
                     submit_batch=celery_submitter(redis_url), journal=journal)
    freeze_startup_objects()
    keep_cancellations()  # uvicorn handles the signals; a client gone cancels its request's Redis calls
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False)
    try:
        await uvicorn.Server(config).serve()
    finally:
        await redis.aclose()
        journal.close()
