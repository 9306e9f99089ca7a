"""`tokenfleet gateway`: the FastAPI app under uvicorn."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from gateway.delivery_journal import open_journal
from services.base.asyncio_tasks import keep_cancellations
from services.base.gc_tuning import freeze_startup_objects
from services.base.redis_client import connect
from services.base.settings import AccountingSettings, CacheSettings, GatewaySettings, RouterSettings, StreamSettings
from services.jobs.tasks import celery_submitter
from services.tenancy.prices import PriceTable
from services.tenancy.sla import SlaPolicy


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
