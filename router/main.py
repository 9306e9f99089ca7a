"""`tokenfleet router`."""

from __future__ import annotations

import os
import socket
import time

from cache.response_cache import ResponseCache
from router.policy import TierPolicy, TierRule
from router.service import Router
from router.worker_choice import RoundRobinChooser, WorkerChooser
from services.base import protocol as p
from services.base.gc_tuning import started
from services.base.redis_client import as_text, connect
from services.base.settings import CacheSettings, RouterSettings, StreamSettings


def tier_policy(settings: RouterSettings) -> TierPolicy:
    rule = TierRule(settings.small_model, settings.large_model, settings.auto_max_prompt_tokens,
                    settings.auto_max_tokens)
    if not settings.classifier_path:
        return TierPolicy(rule)
    from cache.embedder import shared_embedder
    from router.classifier import TierClassifier

    return TierPolicy(rule, TierClassifier.load(settings.classifier_path), settings.classifier_threshold,
                      shared_embedder())


def consumer_name() -> str:
    """This router's name in the request stream's consumer group."""
    return f"{socket.gethostname()}-{os.getpid()}"


async def is_alive(redis_url: str, within_s: float = 30.0) -> bool:
    """Whether a router on this host showed it was alive within `within_s` (it does every 5 s): the container
    healthcheck of a service with no HTTP port."""
    redis = connect(redis_url)
    try:
        seen = await redis.hgetall(p.ROUTERS_KEY)
    finally:
        await redis.aclose()
    mine = f"{socket.gethostname()}-"
    return any(as_text(name).startswith(mine) and float(at) > time.time() - within_s for name, at in seen.items())


async def serve(settings: RouterSettings, redis_url: str) -> None:
    chooser = (RoundRobinChooser() if settings.worker_policy == "round_robin" else
               WorkerChooser(settings.min_prefix_tokens, settings.load_cost_tokens))
    tiers = tier_policy(settings)
    redis = connect(redis_url)
    stop = started()
    try:
        caches, router_id = ResponseCache(redis, CacheSettings()), consumer_name()
        await Router(redis, tiers, chooser, caches, router_id, StreamSettings(), settings.max_concurrency).run(stop)
    finally:
        await redis.aclose()
