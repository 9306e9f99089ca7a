"""The stream protocol, defined once: stream and key names, message schemas, their serialization.

Every message is one Redis stream entry with a single field, `m`, holding the model's JSON; every schema
carries `v` (the schema version) and `traceparent` (W3C trace context) so one trace spans every hop.

    gateway --GenerateRequest--> REQUESTS_STREAM --router--> work_stream(model) --worker
    worker  --ReplyChunk-------> reply_stream(request_id) --gateway (client)
    worker  --CompletionEvent--> EVENTS_STREAM --accounting
    gateway --DeliveryCut------> EVENTS_STREAM + delivered_key(request_id) (what its client got of a response
                                 it ended short)
    worker  --DeadLetter-------> DEAD_LETTER_STREAM (after MAX_DELIVERIES)
    gateway --request_id-------> CANCEL_CHANNEL (pub/sub) + cancel_key(request_id)  --worker aborts
    gateway --batch id---------> Celery's batch queue --batch job--> REQUESTS_STREAM (as the gateway enqueues)
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

SCHEMA_VERSION = 1
PREFIX = "tf"

REQUESTS_STREAM = f"{PREFIX}:requests"
EVENTS_STREAM = f"{PREFIX}:events"
DEAD_LETTER_STREAM = f"{PREFIX}:dead-letter"
CANCEL_CHANNEL = f"{PREFIX}:cancel"
MODELS_KEY = f"{PREFIX}:models"  # hash: served model name -> ModelInfo JSON
API_KEYS_KEY = f"{PREFIX}:api-keys"  # hash: sha256(key) -> ApiKeyRecord JSON
ROUTER_GROUP = "router"
WORKER_GROUP = "workers"
AUTO_MODEL = "auto"
FIELD = "m"


def work_stream(model: str) -> str:
    return f"{PREFIX}:work:{model}"


def reply_stream(request_id: str) -> str:
    return f"{PREFIX}:reply:{request_id}"


# Hash: each router's consumer name -> when it last showed it was alive (a router has no HTTP port to probe).
ROUTERS_KEY = f"{PREFIX}:routers"


def workers_key(model: str) -> str:
    """Sorted set of a model's workers, scored by the time their heartbeat expires."""
    return f"{PREFIX}:workers:{model}"


def heartbeat_key(model: str, worker_id: str) -> str:
    return f"{PREFIX}:heartbeat:{model}:{worker_id}"


def inbox_stream(model: str, worker_id: str) -> str:
    """One worker's own work stream: the router sends here what it wants that worker (its cache) to serve."""
    return f"{PREFIX}:inbox:{model}:{worker_id}"


def inboxes_key(model: str) -> str:
    """Set of the worker ids that have an inbox: live workers adopt a dead one's inbox from it."""
    return f"{PREFIX}:inboxes:{model}"


def prefix_blocks_key(model: str, worker_id: str) -> str:
    """Set of the KV block hashes a worker holds in its prefix cache (the prefix directory)."""
    return f"{PREFIX}:prefix-blocks:{model}:{worker_id}"


def prefix_events_stream(model: str) -> str:
    """A model's workers' prefix-cache changes (PrefixChange), which routers follow."""
    return f"{PREFIX}:prefix-events:{model}"


def cancel_key(request_id: str) -> str:
    return f"{PREFIX}:cancelled:{request_id}"


# Kept past any request's deadline, so that an event written late (a worker that resumed after an outage) still
# finds how many tokens its client got.
DELIVERED_TTL_S = 2 * 86_400


def delivered_key(request_id: str) -> str:
    """String: the completion tokens a client got of a response its gateway ended short (`replies.end_for_client`);
    the ledger bills no more than this, whichever of the gateway's word and the worker's event comes first."""
    return f"{PREFIX}:delivered:{request_id}"


def idempotency_key(api_key_hash: str, key: str) -> str:
    return f"{PREFIX}:idempotency:{api_key_hash}:{key}"


# The Batch API (services/batch/store.py, services/batch/runner.py). Every key below expires BATCH_TTL_S after
# its last write: files and batches are kept a week, as OpenAI keeps a batch's output for its window and more.
BATCH_TTL_S = 7 * 24 * 3600
# The engine schedules lower values first (gpu_worker/engine/scheduler.py) and preempts the highest first, with
# aging so a batch line never starves; interactive requests keep 0.
BATCH_PRIORITY = 10


def batch_file_key(file_id: str) -> str:
    """Hash: an uploaded (or a batch's output) file: its metadata fields, its owner (`tenant`), `content`."""
    return f"{PREFIX}:batch-file:{file_id}"


def batch_key(batch_id: str) -> str:
    """Hash: a batch record, each field a JSON value (so the job and a cancel write different fields)."""
    return f"{PREFIX}:batch:{batch_id}"


def batches_key(tenant: str) -> str:
    """Sorted set: a tenant's batch ids by creation time (GET /v1/batches)."""
    return f"{PREFIX}:batches:{tenant}"


# Batches a job is running or may run (created, not yet final), across tenants: what the sweep
# (services/batch/lease.py) looks through for a batch whose job died.
ACTIVE_BATCHES_KEY = f"{PREFIX}:batches-active"


def batch_lease_key(batch_id: str) -> str:
    """String with a TTL: the token of the job running the batch (refreshed while it runs), or `queued` while a
    job the sweep sent for it waits in Celery's queue."""
    return f"{PREFIX}:batch-lease:{batch_id}"


def batch_submitted_key(batch_id: str) -> str:
    """Hash: custom_id -> 1 for each line whose request was put on the request stream (in the same transaction),
    so that a job re-run after a crash follows it rather than sending it twice, even before any worker took it."""
    return f"{PREFIX}:batch-submitted:{batch_id}"


def batch_output_key(batch_id: str) -> str:
    """Hash: custom_id -> its output line, for lines that succeeded; what a re-run job skips."""
    return f"{PREFIX}:batch-output:{batch_id}"


def batch_errors_key(batch_id: str) -> str:
    """Hash: custom_id -> its error line, for lines that failed."""
    return f"{PREFIX}:batch-errors:{batch_id}"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    v: int = SCHEMA_VERSION
    traceparent: str | None = None

    def encode(self) -> dict[str, str]:
        return {FIELD: self.model_dump_json(exclude_none=True)}


M = TypeVar("M", bound=Message)


def raw_message(fields: dict) -> str | None:
    """A stream entry's message JSON, as `encode` wrote it (None: the entry has none)."""
    raw = fields.get(FIELD) if FIELD in fields else fields.get(FIELD.encode())
    return raw.decode() if isinstance(raw, bytes) else raw


def decode(cls: type[M], fields: dict) -> M:
    return cls.model_validate_json(raw_message(fields))


class SamplingOptions(BaseModel):
    """What the engine's `SamplingParams` takes, already validated by the gateway."""

    model_config = ConfigDict(extra="forbid")
    n: int = 1
    max_tokens: int | None = None  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per token (0: the sampled token's own only)


class RoutingDecision(BaseModel):
    """Why a request went where it went; carried to the worker and into the completion event."""

    model: str
    reason: str  # the tier (model) choice
    decided_at: float
    worker: str | None = None  # None: the model's shared stream, any worker
    worker_reason: str | None = None
    prefix_tokens: int = 0  # of the prompt, cached on the chosen worker when the router looked
    decision_ms: float | None = None  # time to choose the worker (directory lookup + scoring)
    cache: str | None = None  # response cache: "miss", "exact", "semantic"; None when not asked


CacheMode = Literal["off", "exact", "semantic"]  # semantic also answers exact repeats


class CacheFill(BaseModel):
    """Set by the router on a response-cache miss: what the worker stores once the request finishes."""

    tenant: str
    exact_key: str | None = None  # a deterministic request: its Redis key in the exact cache
    semantic_scope: str | None = None  # the model, kind and cache salt it may answer for (with the tenant)
    semantic_text: str | None = None  # the conversation as embedded
    semantic_vector: str | None = None  # its embedding (base64 float32): computed once, by the router


class PromptTokenIds(BaseModel):
    """A text prompt's token ids (a chat's: its chat template applied to the messages), computed once on the way
    in by the first hop holding the tokenizer of a model the request may run on: the gateway at admission, else
    the router, else the worker. A later hop reads them rather than tokenize again.

    Keyed by the tokenizer's fingerprint (`services.text.tokenizer.Tokenizer.fingerprint`): models sharing a
    tokenizer share one list, and a worker uses only ids its own tokenizer would have given (a host whose
    files differ from the worker's is not trusted). A model absent from `tokenizers` had no hop able to
    tokenize for it yet, or its tokenizer refused the prompt (the worker's error then tells the client)."""

    model_config = ConfigDict(extra="forbid")
    ids: dict[str, list[int]] = Field(default_factory=dict)  # tokenizer fingerprint -> the prompt's ids
    tokenizers: dict[str, str] = Field(default_factory=dict)  # served model name -> its tokenizer's fingerprint


class GenerateRequest(Message):
    request_id: str
    kind: Literal["chat", "completion"]
    model: str  # as the client asked: a served model or AUTO_MODEL
    messages: list[dict[str, Any]] | None = None  # chat
    prompt: str | list[int] | None = None  # completion
    prompt_token_ids: PromptTokenIds | None = None  # None: a prompt of ids, or no hop tokenized it yet
    sampling: SamplingOptions
    api_key_name: str | None = None
    api_key_id: str | None = None  # the key's hash: budgets are kept per key
    user: str | None = None
    cache_salt: str | None = None  # prefix-cache hits only among requests with the same salt
    cache_mode: CacheMode = "off"  # the response caches: as the request or else its API key asks
    sla_class: str | None = None  # as the request or else its API key asks; None: the deployment's default
    priority: int = 0  # the engine's: lower runs first; batch lines are BATCH_PRIORITY
    cache_fill: CacheFill | None = None
    created: int = Field(default_factory=lambda: int(time.time()))
    enqueued_at: float = Field(default_factory=time.time)
    # Seconds since the epoch past which nobody waits for the answer: work not started by then never starts, work
    # running then is stopped, and its ledger row says `expired`. None: no deadline (messages of older gateways).
    deadline: float | None = None
    routing: RoutingDecision | None = None

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (time.time() if now is None else now) >= self.deadline


class TokenLogprob(BaseModel):
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = Field(default_factory=list)  # (token id, text, logprob)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the worker's prefix cache
    # Speculative decoding: guesses the worker scored for the request, and those the verifier accepted (as vLLM
    # counts them: an accepted guess past a stop is counted, though not emitted or billed).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timing(BaseModel):
    queue_s: float  # enqueued at the gateway -> admitted by the engine
    ttft_s: float  # enqueued -> first token
    tpot_s: float  # mean time per output token after the first
    e2e_s: float  # enqueued -> finished
    engine_s: float  # admitted by the engine -> finished (the engine's own time for the request)
    engine_step_s: float  # the request's share of measured engine step time
    route_s: float | None = None  # enqueued -> routed (the router's queue and decision); None: not routed

    @classmethod
    def unserved(cls, enqueued_at: float) -> Timing:
        """A request no engine worked on (a cache answer, or one that ended before it ran): all of its time
        since enqueueing was waiting."""
        elapsed = time.time() - enqueued_at
        return cls(queue_s=elapsed, ttft_s=elapsed, tpot_s=0.0, e2e_s=elapsed, engine_s=0.0, engine_step_s=0.0)


class ReplyChunk(Message):
    """One message on a request's reply stream. Token deltas are numbered per choice by `position` (index of
    their first token in that choice's output) so a reader can drop what a resumed worker repeats."""

    kind: Literal["started", "delta", "finished", "error"]
    worker_id: str | None = None
    index: int = 0  # choice
    position: int = 0
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # on a choice's last delta
    model: str | None = None  # on "started": the model that serves the request
    prompt_tokens: int | None = None  # on "started"
    cache: str | None = None  # on "started" and "finished": the response cache's answer (routing.cache)
    usage: Usage | None = None  # on "finished"
    timing: Timing | None = None  # on "finished"
    error: ErrorBody | None = None  # on "error"


class ErrorBody(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    status: int = 400  # the HTTP status the gateway answers with (not part of OpenAI's body)

    def openai(self) -> dict:
        return {"error": self.model_dump(exclude={"status"})}


ReplyChunk.model_rebuild()


def deadline_exceeded() -> ErrorBody:
    return ErrorBody(message="the request's deadline passed before it finished", type="server_error",
                     code="deadline_exceeded", status=504)


# "rejected": refused for the client's own fault (a prompt past the context, a bad parameter); its own status,
# so that SLA attainment and goodput count only what the service could have served. "expired": its deadline
# passed before it finished (never started, or stopped where it ran).
TaskStatus = Literal["ok", "error", "cancelled", "dead-lettered", "rejected", "expired"]


class CompletionEvent(Message):
    """For the accounting service: one per request that ended, whatever the outcome (`status`)."""

    request_id: str
    model: str
    worker_id: str
    api_key_name: str | None = None
    api_key_id: str | None = None
    user: str | None = None
    finish_reasons: list[str | None]
    usage: Usage
    timing: Timing
    routing: RoutingDecision | None = None
    deliveries: int = 1
    status: TaskStatus = "ok"
    tier: str | None = None
    worker_class: str | None = None  # prices the measured cost (engine seconds x its cost per hour)
    sla_class: str | None = None
    enqueued_at: float | None = None
    finished_at: float = Field(default_factory=time.time)

    @classmethod
    def abandoned(cls, request: GenerateRequest, status: TaskStatus, worker_id: str, usage: Usage | None = None,
                  **worker_fields) -> CompletionEvent:
        """A request that ended without finishing: what is known of it, timed from its enqueueing."""
        return cls(request_id=request.request_id, model=request.routing.model if request.routing else request.model,
                   worker_id=worker_id, api_key_name=request.api_key_name, api_key_id=request.api_key_id,
                   user=request.user, finish_reasons=[],
                   usage=usage or Usage(prompt_tokens=0, completion_tokens=0),
                   timing=Timing.unserved(request.enqueued_at), routing=request.routing,
                   status=status, sla_class=request.sla_class, enqueued_at=request.enqueued_at,
                   traceparent=request.traceparent, **worker_fields)


class DeliveryCut(Message):
    """The gateway's word that a client did not get the whole of a response: the client left, the gateway stopped
    waiting (a Redis outage, the deadline), or the gateway died and its successor read its journal. The ledger row
    bills `delivered_tokens`, what the client got, and says `cancelled` where it said ok; a row not written yet is
    billed so from `delivered_key` when its event comes."""

    request_id: str
    delivered_tokens: int


_EVENT = TypeAdapter(CompletionEvent | DeliveryCut)


def decode_event(fields: dict) -> CompletionEvent | DeliveryCut:
    """An events-stream entry (`extra="forbid"` keeps the two shapes apart)."""
    return _EVENT.validate_json(raw_message(fields))


def completion_events(entries) -> list[CompletionEvent]:
    """The completion events among an events stream's (entry id, fields) pairs, in order."""
    return [e for _, fields in entries if isinstance(e := decode_event(fields), CompletionEvent)]


class DeadLetter(Message):
    request_id: str
    stream: str
    entry_id: str
    deliveries: int
    reason: str
    request: GenerateRequest | None = None
    event: CompletionEvent | None = None  # a completion event the ledger refused


class PrefixChange(Message):
    """A worker's prefix-cache changes since its last: runs of (added?, block hashes), in order. `replace`:
    the runs are all it holds now (none: it holds nothing, e.g. after a restart)."""

    worker_id: str
    replace: bool = False
    runs: list[tuple[bool, list[int]]] = Field(default_factory=list)


class ModelInfo(BaseModel):
    name: str
    model_dir: str  # the checkpoint on the worker's host (an HF directory or a .gguf file): routers tokenize with it
    max_model_len: int
    tier: Annotated[str, Field(description="small / large / small,large (both) / other")] = "other"
    kv_block_size: int = 16  # tokens per KV block: the router hashes prompts in blocks of this size


class WorkerStatus(BaseModel):
    worker_id: str
    model: str
    running: int
    waiting: int
    inflight: int = 0  # requests taken from the streams and not finished (running, waiting, or starting)
    backlog: int = 0  # requests in its inbox it has not read yet
    kv_blocks_used: int
    kv_blocks_total: int
    draining: bool = False
    metrics_port: int | None = None  # its Prometheus /metrics, when served
    updated_at: float


class CachedChoice(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: str | None


class CachedCompletion(BaseModel):
    """A finished response as the response caches keep it: a worker writes it, a later hit replays it."""

    model: str
    choices: list[CachedChoice]
    usage: Usage
    max_tokens: int | None = None  # the limit it was generated under: a choice cut by it fits only the same limit
    created_at: float = Field(default_factory=time.time)


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
