"""`tokenfleet router`."""

from __future__ import annotations

import os
import socket

from cache.response_cache import ResponseCache
from router.policy import TierPolicy, TierRule
from router.service import Router
from router.worker_choice import RoundRobinChooser, WorkerChooser
from services.gc_tuning import started
from services.redis_client import connect
from services.settings import CacheSettings, RouterSettings, StreamSettings


def tier_policy(settings: RouterSettings) -> TierPolicy:
    rule = TierRule(settings.small_model, settings.large_model, settings.auto_max_prompt_tokens,
                    settings.auto_max_tokens)
    if not settings.classifier_path:
        return TierPolicy(rule)
    from cache.embedder import shared_embedder
    from router.classifier import TierClassifier

    return TierPolicy(rule, TierClassifier.load(settings.classifier_path), settings.classifier_threshold,
                      shared_embedder())


async def serve(settings: RouterSettings, redis_url: str) -> None:
    chooser = (RoundRobinChooser() if settings.worker_policy == "round_robin" else
               WorkerChooser(settings.min_prefix_tokens, settings.load_cost_tokens))
    tiers = tier_policy(settings)
    redis = connect(redis_url)
    stop = started()
    try:
        caches, router_id = ResponseCache(redis, CacheSettings()), f"{socket.gethostname()}-{os.getpid()}"
        await Router(redis, tiers, chooser, caches, router_id, StreamSettings(), settings.max_concurrency).run(stop)
    finally:
        await redis.aclose()
