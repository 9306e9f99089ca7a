"""OpenAI's Batch API: files (`/v1/files`, purpose "batch") and batches (`/v1/batches`), kept in Redis for
`p.BATCH_TTL_S` and scoped to the API key's tenant (another tenant's ids answer 404, as unknown ones do).

The gateway only validates and records; the lines run in a Celery job on the low-priority batch queue
(services/batch/runner.py), which writes the output and error files back here.

A batch not finished by its `expires_at` (created_at + TOKENFLEET_GATEWAY_BATCH_COMPLETION_WINDOW_S, OpenAI's
"24h") expires, as OpenAI's do: the lines answered stay in its output and error files, the others are not run
and appear in the error file as `batch_expired`. `expire_if_due` does it, called by the job at its deadline and
by every read of the batch (get, list, cancel), so the deadline holds with the job dead or no Celery worker up."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from fastapi import Query, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from services.base import protocol as p
from services.base.redis_client import as_text
from services.openai_api.request_body import load_json
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest, RequestError, parse
from services.tenancy.auth import ApiKey

ENDPOINTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
MAX_FILE_BYTES = 100 << 20  # a file lives in one Redis value
MAX_FILE_LINES = 50_000  # requests in one batch, as OpenAI allows
ACTIVE = ("validating", "in_progress")
FINAL = ("completed", "failed", "cancelled", "expired")
UNFINISHED = (*ACTIVE, "cancelling")  # what expires when its window ends ("finalizing" is an expiry under way)
RESENT_FIELD = "jobs_resent"  # jobs the sweep sent for the batch (services/batch/lease.py)
# An expiry whose writer has not finished this long after it began (it died) is finished by the next reader.
EXPIRY_TAKEOVER_S = 60
EXPIRED_ERROR = {"code": "batch_expired",
                 "message": "The request could not be executed before the batch's completion window ended."}
# A compare-and-set on a batch's status: the job and a cancel write the same record from two processes.
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
for i = 2, tonumber(ARGV[1]) + 1 do
  if current == ARGV[i] then
    for j = tonumber(ARGV[1]) + 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
    return 1
  end
end
return 0
"""


def _not_found(kind: str, object_id: str) -> RequestError:
    return RequestError(p.ErrorBody(message=f"No {kind} found with id '{object_id}'", code="not_found", status=404))


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(p.ErrorBody(message=message, param=param))


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict

    def request(self):
        """The validated request, as the endpoint's handler parses it."""
        return parse(ENDPOINTS[self.url], self.body)


def _line(raw: str) -> BatchLine:
    obj = load_json(raw)
    if not isinstance(obj, dict):
        raise _bad("not a JSON object")
    if not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        raise _bad("'custom_id' must be a non-empty string")
    if obj.get("method") != "POST":
        raise _bad("'method' must be \"POST\"")
    if not isinstance(obj.get("url"), str) or obj["url"] not in ENDPOINTS:
        raise _bad(f"'url' must be one of {', '.join(ENDPOINTS)}")
    line = BatchLine(obj["custom_id"], obj["url"], obj.get("body"))
    if line.request().stream:
        raise _bad("'body.stream' cannot be true in a batch")
    return line


def read_lines(content: bytes) -> list[BatchLine]:
    """Every line of a batch input file, validated; else a 400 naming the first bad line (1-based)."""
    try:
        text = content.decode()
    except UnicodeDecodeError:
        raise _bad("the file is not UTF-8 text", "file") from None
    lines, seen = [], set()
    for number, raw in enumerate(text.splitlines(), 1):
        if len(lines) == MAX_FILE_LINES:
            raise _bad(f"the file holds more than {MAX_FILE_LINES} requests", "file")
        if not raw.strip():
            continue
        try:
            line = _line(raw)
            if line.custom_id in seen:
                raise _bad(f"duplicate custom_id {line.custom_id!r}")
        except RequestError as exc:
            raise RequestError(p.ErrorBody(message=f"line {number}: {exc.error.message}", param=f"line {number}",
                                           code="invalid_batch_line")) from None
        seen.add(line.custom_id)
        lines.append(line)
    return lines


async def store_file(redis: aioredis.Redis, tenant: str, content: bytes, filename: str, purpose: str,
                     **extra: str) -> dict:
    """Stores a file; returns its OpenAI file object."""
    meta = {"id": f"file-{uuid.uuid4().hex}", "object": "file", "bytes": len(content), "created_at": int(time.time()),
            "filename": filename, "purpose": purpose, "status": "processed", "status_details": None}
    key = p.batch_file_key(meta["id"])
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={"meta": json.dumps(meta), "tenant": tenant, "content": content, **extra})
        pipe.expire(key, p.BATCH_TTL_S)
        await pipe.execute()
    return meta


async def load_file(redis: aioredis.Redis, file_id: str, tenant: str | None = None) -> dict[str, Any] | None:
    """The file's fields (`meta` decoded, `content` as bytes), or None when unknown or another tenant's."""
    fields = await redis.hgetall(p.batch_file_key(file_id))
    fields = {as_text(k): v for k, v in fields.items()}
    if not fields or (tenant is not None and as_text(fields["tenant"]) != tenant):
        return None
    content = fields["content"]
    return {**{k: as_text(v) for k, v in fields.items()}, "meta": json.loads(fields["meta"]),
            "content": content if isinstance(content, bytes) else content.encode()}


async def load_batch(redis: aioredis.Redis, batch_id: str) -> dict[str, Any] | None:
    fields = await redis.hgetall(p.batch_key(batch_id))
    return {as_text(k): json.loads(v) for k, v in fields.items()} or None


async def transition(redis: aioredis.Redis, batch_id: str, allowed: tuple[str, ...], **fields: Any) -> bool:
    """Writes `fields` (e.g. a new `status`) only while the batch's status is one of `allowed`."""
    args = [len(allowed), *(json.dumps(s) for s in allowed)]
    for name, value in fields.items():
        args += [name, json.dumps(value)]
    return bool(await redis.eval(_TRANSITION, 1, p.batch_key(batch_id), *args))


async def request_counts(redis: aioredis.Redis, batch: dict) -> dict:
    """Counted from the job's result hashes, so a job re-run after a crash never counts a line twice."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hlen(p.batch_output_key(batch["id"]))
        pipe.hlen(p.batch_errors_key(batch["id"]))
        completed, failed = await pipe.execute()
    return {"total": batch["request_counts"]["total"], "completed": completed, "failed": failed}


def line_request_id(batch_id: str, custom_id: str) -> str:
    """A line's request id (`batch_req_<id>` in its output), the same in every run of the batch's job."""
    return hashlib.sha256(f"{batch_id}\0{custom_id}".encode()).hexdigest()[:32]


async def input_order(redis: aioredis.Redis, batch: dict) -> list[str]:
    """The custom_ids of the batch's input file, in file order ([] once the file has expired)."""
    file = await load_file(redis, batch["input_file_id"])
    return [line.custom_id for line in read_lines(file["content"])] if file else []


async def store_results(redis: aioredis.Redis, batch: dict, order: list[str]) -> dict[str, str]:
    """The output and error files from the job's result hashes (lines in input order); returns the batch's
    `output_file_id` / `error_file_id` fields for those that have lines."""
    files = {}
    for field, key, name in (("output_file_id", p.batch_output_key(batch["id"]), "output"),
                             ("error_file_id", p.batch_errors_key(batch["id"]), "errors")):
        results = {as_text(k): as_text(v) for k, v in (await redis.hgetall(key)).items()}
        if results:
            content = "".join(results[c] + "\n" for c in order if c in results).encode()
            meta = await store_file(redis, batch["tenant"], content, f"{batch['id']}_{name}.jsonl", "batch_output")
            files[field] = meta["id"]
    return files


async def expire_if_due(redis: aioredis.Redis, batch: dict, now: float | None = None) -> dict:
    """The batch, expired first if its window ended (`now` >= `expires_at`) before it reached a final state.

    Two steps, so that the files hold exactly what was answered in time: (1) a compare-and-set to `finalizing`
    with `expired_at` freezes the results (the job records a line only while the batch is `in_progress` or
    `cancelling`) and makes this caller the one that writes; (2) the lines with no result are recorded as
    `batch_expired` errors, the files are written, and the batch becomes `expired`. Step 2 is idempotent: an
    expiry whose writer died is finished by the first read after EXPIRY_TAKEOVER_S."""
    now = int(time.time() if now is None else now)
    if batch["status"] in FINAL or now < batch["expires_at"]:
        return batch
    if not await transition(redis, batch["id"], UNFINISHED, status="finalizing", expired_at=now, finalizing_at=now):
        batch = await load_batch(redis, batch["id"]) or batch
        if not (batch["status"] == "finalizing" and batch["expired_at"] is not None
                and now - batch["finalizing_at"] >= EXPIRY_TAKEOVER_S):
            return batch  # final meanwhile, or another process is expiring it now
    order = await input_order(redis, batch)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hkeys(p.batch_output_key(batch["id"]))
        pipe.hkeys(p.batch_errors_key(batch["id"]))
        answered = {as_text(custom_id) for keys in await pipe.execute() for custom_id in keys}
    unrun = {c: json.dumps({"id": f"batch_req_{line_request_id(batch['id'], c)}", "custom_id": c,
                            "response": None, "error": EXPIRED_ERROR}) for c in order if c not in answered}
    if unrun:
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hset(p.batch_errors_key(batch["id"]), mapping=unrun)
            pipe.expire(p.batch_errors_key(batch["id"]), p.BATCH_TTL_S)
            await pipe.execute()
    await transition(redis, batch["id"], ("finalizing",), status="expired",
                     **await store_results(redis, batch, order))
    return await load_batch(redis, batch["id"]) or batch


class Batches:
    """The handlers. `submit(batch_id)` hands a new batch to the job that runs it; a batch expires
    `completion_window_s` after its creation (the gateway passes TOKENFLEET_GATEWAY_BATCH_COMPLETION_WINDOW_S)."""

    PRIVATE = ("tenant", "key", RESENT_FIELD)  # record fields for the job and its sweep, never shown

    def __init__(self, redis: aioredis.Redis, authenticated: Callable[[Request], Awaitable[ApiKey]],
                 submit: Callable[[str], Awaitable[None]] | None, completion_window_s: int):
        self.redis, self.authenticated, self.submit = redis, authenticated, submit
        self.completion_window_s = completion_window_s

    async def upload_file(self, request: Request) -> dict:
        api_key = await self.authenticated(request)
        async with request.form() as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose != "batch":
                raise _bad("'purpose' must be \"batch\" (the only purpose this server stores)", "purpose")
            if not isinstance(upload, UploadFile):
                raise _bad("'file' must be an uploaded file", "file")
            content, filename = await upload.read(MAX_FILE_BYTES + 1), upload.filename or "batch.jsonl"
        if len(content) > MAX_FILE_BYTES:
            raise _bad(f"the file is over {MAX_FILE_BYTES >> 20} MiB", "file")
        lines = read_lines(content)
        if not lines:
            raise _bad("the file has no requests", "file")
        endpoints = sorted({line.url for line in lines})
        return await store_file(self.redis, api_key.name, content, filename, "batch", endpoints=json.dumps(endpoints),
                                lines=str(len(lines)))

    async def _file(self, request: Request, file_id: str) -> dict:
        api_key = await self.authenticated(request)
        found = await load_file(self.redis, file_id, api_key.name)
        if found is None:
            raise _not_found("file", file_id)
        return found

    async def get_file(self, request: Request, file_id: str) -> dict:
        return (await self._file(request, file_id))["meta"]

    async def file_content(self, request: Request, file_id: str) -> Response:
        return Response((await self._file(request, file_id))["content"], media_type="application/jsonl")

    async def create_batch(self, request: Request) -> dict:
        api_key = await self.authenticated(request)
        body = load_json(await request.body())
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        if not isinstance(body.get("endpoint"), str) or body["endpoint"] not in ENDPOINTS:
            raise _bad(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if body.get("completion_window") != "24h":
            raise _bad("'completion_window' must be \"24h\"", "completion_window")
        file = await load_file(self.redis, str(body.get("input_file_id")), api_key.name)
        if file is None or file["meta"]["purpose"] != "batch":
            raise _bad(f"no batch input file with id '{body.get('input_file_id')}'", "input_file_id")
        if json.loads(file["endpoints"]) != [body["endpoint"]]:
            raise _bad(f"every line of the input file must have 'url' {body['endpoint']!r}", "endpoint")
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": body["endpoint"], "errors": None,
                 "input_file_id": file["meta"]["id"], "completion_window": "24h", "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + self.completion_window_s, "finalizing_at": None, "completed_at": None,
                 "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": int(file["lines"]), "completed": 0, "failed": 0},
                 "metadata": body.get("metadata"), "tenant": api_key.name,
                 "key": {"name": api_key.name, "hash": api_key.hash, "cache_mode": api_key.cache_mode,
                         "prefix_group": api_key.prefix_group}}
        key, index = p.batch_key(batch["id"]), p.batches_key(api_key.name)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={name: json.dumps(value) for name, value in batch.items()})
            pipe.expire(key, p.BATCH_TTL_S)
            pipe.zadd(index, {batch["id"]: time.time()})
            pipe.expire(index, p.BATCH_TTL_S)
            pipe.zadd(p.ACTIVE_BATCHES_KEY, {batch["id"]: time.time()})
            await pipe.execute()
        if self.submit is not None:
            try:
                await self.submit(batch["id"])
            except Exception as exc:  # not queued (the broker is down): fail it rather than leave it waiting forever
                await transition(self.redis, batch["id"], ("validating",), status="failed", failed_at=int(time.time()),
                                 errors={"object": "list", "data": [{"code": "not_queued", "message": str(exc)}]})
                raise RequestError(p.ErrorBody(message=f"could not queue the batch: {exc}", type="server_error",
                                               code="not_queued", status=503)) from None
        return self._public(batch)

    def _public(self, batch: dict) -> dict:
        return {k: v for k, v in batch.items() if k not in self.PRIVATE}

    async def _batch(self, request: Request, batch_id: str) -> dict:
        api_key = await self.authenticated(request)
        batch = await load_batch(self.redis, batch_id)
        if batch is None or batch["tenant"] != api_key.name:
            raise _not_found("batch", batch_id)
        return await expire_if_due(self.redis, batch)

    async def _view(self, batch: dict) -> dict:
        return self._public({**batch, "request_counts": await request_counts(self.redis, batch)})

    async def get_batch(self, request: Request, batch_id: str) -> dict:
        return await self._view(await self._batch(request, batch_id))

    async def cancel_batch(self, request: Request, batch_id: str) -> dict:
        """The job stops submitting lines once it sees `cancelling`, then finalizes the batch as cancelled."""
        await self._batch(request, batch_id)  # 404 unless the caller's; expired first if past its window
        await transition(self.redis, batch_id, ACTIVE, status="cancelling", cancelling_at=int(time.time()))
        return await self._view(await load_batch(self.redis, batch_id))

    async def list_batches(self, request: Request, limit: int = Query(20, ge=1, le=100),
                           after: str | None = Query(None, max_length=256)) -> dict:
        api_key = await self.authenticated(request)
        ids = [as_text(i) for i in await self.redis.zrevrange(p.batches_key(api_key.name), 0, -1)]
        if after in ids:
            ids = ids[ids.index(after) + 1:]
        data = [await self._view(await expire_if_due(self.redis, b)) for i in ids[:max(1, min(limit, 100)) + 1]
                if (b := await load_batch(self.redis, i)) is not None]
        page = data[:max(1, min(limit, 100))]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(data) > len(page)}
