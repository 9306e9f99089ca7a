"""`tokenfleet router`."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

from router.policy import TierRule
from router.service import Router
from services.gc_tuning import freeze_startup_objects
from services.redis_client import connect
from services.settings import RouterSettings, StreamSettings


async def serve(settings: RouterSettings, redis_url: str) -> None:
    rule = TierRule(settings.small_model, settings.large_model, settings.auto_max_prompt_tokens,
                    settings.auto_max_tokens)
    redis = connect(redis_url)
    freeze_startup_objects()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await Router(redis, rule, f"{socket.gethostname()}-{os.getpid()}", StreamSettings()).run(stop)
    finally:
        await redis.aclose()
