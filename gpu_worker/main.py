"""`tokenfleet worker`: load the model, join the work stream's consumer group, serve until SIGTERM."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from cache.response_cache import ResponseCache
from gpu_worker.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.service import Worker
from services.base import protocol as p
from services.base.gc_tuning import started
from services.base.redis_client import connect
from services.base.settings import CacheSettings, StreamSettings, WorkerSettings
from services.text.model_paths import is_model_name


def served_name(settings: WorkerSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    return settings.model if is_model_name(settings.model) else Path(settings.model).stem


async def serve(settings: WorkerSettings, redis_url: str) -> None:
    engine = LLMEngine(EngineConfig(model=settings.model, dtype=settings.dtype, device=settings.device,
                                    quantization=settings.quantization, kv_cache_dtype=settings.kv_cache_dtype,
                                    speculative=settings.speculative, deterministic=settings.deterministic,
                                    enforce_eager=settings.enforce_eager,
                                    max_num_seqs=settings.max_num_seqs,
                                    max_num_batched_tokens=settings.max_num_batched_tokens,
                                    kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
                                    block_size=settings.kv_block_size))
    name = served_name(settings)
    info = p.ModelInfo(name=name, model_dir=str(engine.model_path), max_model_len=engine.max_model_len,
                       tier=settings.tier, kv_block_size=engine.block_size)
    worker_id = f"{socket.gethostname()}-{os.getpid()}"
    metrics = WorkerMetrics(engine, name)
    metrics_port = metrics.serve(settings.metrics_port)
    redis = connect(redis_url)
    stop = started()
    logging.getLogger(__name__).info("worker %s serving %s (metrics on port %s)", worker_id, name, metrics_port)
    try:
        await Worker(redis, AsyncLLMEngine(engine), info, worker_id, settings, StreamSettings(),
                     ResponseCache(redis, CacheSettings()), metrics, metrics_port).run(stop)
    finally:
        await redis.aclose()
