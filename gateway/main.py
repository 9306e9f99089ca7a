"""`tokenfleet gateway`: the FastAPI app under uvicorn."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from gateway.batches import celery_submitter
from services.accounting.sla import SlaPolicy
from services.gc_tuning import freeze_startup_objects
from services.redis_client import connect
from services.settings import AccountingSettings, CacheSettings, GatewaySettings, RouterSettings, StreamSettings


async def serve(settings: GatewaySettings, redis_url: str) -> None:
    redis = connect(redis_url)
    app = create_app(redis, settings, RouterSettings(), StreamSettings(), CacheSettings().default_mode,
                     sla=SlaPolicy.load(AccountingSettings().sla_path), submit_batch=celery_submitter(redis_url))
    freeze_startup_objects()
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False)
    try:
        await uvicorn.Server(config).serve()
    finally:
        await redis.aclose()
