"""The gateway: OpenAI's HTTP API in front of the request stream. Authenticates, validates, enforces the
key's limits (services/tenancy/budgets.py), admits, enqueues, and relays the reply stream back (whole or as SSE)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from gateway import openapi
from gateway.deadlines import client_timeout
from gateway.delivery_journal import DeliveryJournal, UnjournaledDeliveries
from gateway.idempotency import Idempotency
from gateway.relay import Relay, redis_unavailable
from services.base import protocol as p
from services.base import telemetry
from services.base.settings import GatewaySettings, RouterSettings, StreamSettings
from services.batch.store import MAX_FILE_BYTES, Batches
from services.openai_api.admission import REFUSALS, Admission, alive_workers, in_flight, served_models
from services.openai_api.context_window import ContextWindow
from services.openai_api.request_body import BodyLimit, load_json
from services.openai_api.schemas import (
    CACHE_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    cache_mode,
    param_name,
    parse,
)
from services.tenancy.auth import ApiKey, authenticate, register_key
from services.tenancy.budgets import Budgets, Estimator
from services.tenancy.prices import PriceTable
from services.tenancy.sla import SlaPolicy
from services.text.prompt_encoder import PromptEncoder


def _error_response(error: p.ErrorBody, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.openai(), status_code=error.status, headers=headers)


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("tokenfleet_gateway_requests", "HTTP requests by path and status",
                                ["path", "status"], registry=self.registry)
        self.latency = Histogram("tokenfleet_gateway_request_seconds", "Time to the response's headers",
                                 ["path"], registry=self.registry)


class RequestStamp:
    """ASGI middleware: `x-request-id` on every response, and each request's count and latency. Plain ASGI
    rather than `@app.middleware("http")`, whose wrapper relays every SSE chunk through an extra task."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()

        async def send_stamped(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                route = scope.get("route")
                path = route.path if route else "unmatched"
                self.metrics.requests.labels(path, str(message["status"])).inc()
                self.metrics.latency.labels(path).observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, send_stamped)


class Gateway:
    """The handlers, over the components they share; `create_app` wires them to routes."""

    def __init__(self, redis: aioredis.Redis, settings: GatewaySettings, tiers: RouterSettings,
                 stream_settings: StreamSettings, default_cache_mode: p.CacheMode = "off",
                 prices: PriceTable | None = None, sla: SlaPolicy | None = None,
                 journal: DeliveryJournal | UnjournaledDeliveries | None = None):
        self.redis, self.settings, self.default_cache_mode = redis, settings, default_cache_mode
        self.sla = sla or SlaPolicy.load()
        self.idempotency = Idempotency(redis, settings.idempotency_ttl_s)
        # One encoder for the budget estimate and the admission: a prompt is tokenized once, by whichever is first.
        encoder = PromptEncoder()
        admission = Admission(redis, settings, tiers, stream_settings.events_max_backlog, ContextWindow(encoder))
        self.journal = journal or UnjournaledDeliveries()
        self.relay = Relay(redis, admission, self.idempotency, settings, stream_settings, self.journal)
        prices = prices or PriceTable.load()
        self.budgets = Budgets(redis, Estimator(redis, prices, (tiers.small_model, tiers.large_model),
                                                encoder=encoder), settings.request_timeout_s)
        self.metrics = GatewayMetrics()

    async def start(self) -> None:
        """The dev key registered, and the requests dead gateways left open ended for their clients."""
        self.relay.end_inherited(self.journal.inherited)
        if self.settings.dev_key:
            await register_key(self.redis, "dev", self.settings.dev_key)

    async def authenticated(self, request: Request) -> ApiKey:
        found = await authenticate(self.redis, request.headers.get("authorization"))
        if found is None:
            raise RequestError(p.ErrorBody(message="Incorrect or missing API key; pass it as 'Authorization: "
                                                   "Bearer KEY'", type="invalid_request_error",
                                           code="invalid_api_key", status=401))
        return found

    async def generate(self, request: Request, schema) -> Response:
        api_key = await self.authenticated(request)
        req = parse(schema, load_json(await request.body()))
        message = req.to_message(request.state.request_id, api_key.name, api_key.prefix_scope)
        message.api_key_id = api_key.hash  # the ledger's key, and where a budget's settle charges
        message.cache_mode = cache_mode(req.cache, request.headers.get(CACHE_HEADER), api_key.cache_mode,
                                        self.default_cache_mode)
        message.sla_class = self._sla_class(req.sla, api_key)
        message.deadline = message.enqueued_at + self._time_allowed(request, req, message.sla_class)
        operation = "chat" if message.kind == "chat" else "text_completion"
        attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": message.model,
                      "gen_ai.request.temperature": message.sampling.temperature,
                      "gen_ai.request.top_p": message.sampling.top_p, "tokenfleet.request_id": message.request_id,
                      **({"gen_ai.request.max_tokens": message.sampling.max_tokens}
                         if message.sampling.max_tokens is not None else {})}
        # The gateway's span covers admission to the response's start; the hops after it are its children.
        with telemetry.hop(f"{operation} {message.model}", request.headers.get("traceparent"), SpanKind.SERVER,
                           attributes) as span:
            message.traceparent = telemetry.traceparent(span)
            return await self._admit_and_relay(request, req, message, api_key)

    async def _admit_and_relay(self, request: Request, req, message: p.GenerateRequest, api_key: ApiKey) -> Response:
        record = None
        if key := request.headers.get("idempotency-key"):
            first = await self.idempotency.claim(api_key.hash, key, message)
            if first is not None:  # a replay runs nothing: it is neither counted nor charged
                return await self.relay.replay(req, first)
            record = (api_key.hash, key)
        if api_key.limited:
            return await self._limited(req, message, api_key, record, request)
        return await self.relay.run(req, message, record, request.is_disconnected)

    async def _limited(self, req, message: p.GenerateRequest, api_key: ApiKey, record: tuple[str, str] | None,
                       request: Request) -> Response:
        """A request under its key's rate limits and budget: admitted and its cost reserved before the queue
        admission; the reservation is returned when the request surely did not run."""
        try:
            await self.budgets.admit(api_key, message)
        except RequestError:
            if record:
                await self.idempotency.forget(*record)
            raise
        try:
            return await self.relay.run(req, message, record, request.is_disconnected)
        except RequestError as exc:
            if exc.error.code in REFUSALS:  # refused before it was enqueued
                await self.budgets.release(message.request_id)
            raise
        except aioredis.RedisError:  # most likely failed to enqueue; if it ran after all, its settle charges it
            with contextlib.suppress(aioredis.RedisError):  # Redis may be down: the sweep returns it later
                await self.budgets.release(message.request_id)
            raise

    def _sla_class(self, asked: str | None, api_key: ApiKey) -> str | None:
        if asked is not None and asked not in self.sla.classes:
            raise RequestError(p.ErrorBody(message=f"unknown SLA class {asked!r}; one of: "
                                                   f"{', '.join(sorted(self.sla.classes))}", param="sla"))
        return asked or api_key.sla_class

    def _time_allowed(self, request: Request, req, sla_class: str | None) -> float:
        """Seconds from acceptance to the request's deadline: its SLA class's timeout (else the gateway's), or
        the client's own where it sends a shorter one (`client_timeout`)."""
        allowed = self.sla.of(sla_class).timeout_s or self.settings.request_timeout_s
        client = client_timeout(request.headers, req.stream)
        return allowed if client is None else min(allowed, client)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, CompletionRequest)

    async def models(self, request: Request) -> dict:
        await self.authenticated(request)
        served = await served_models(self.redis)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "tokenfleet",
                 "max_model_len": info.max_model_len, "tier": info.tier} for name, info in sorted(served.items())]
        data.append({"id": p.AUTO_MODEL, "object": "model", "created": 0, "owned_by": "tokenfleet"})
        return {"object": "list", "data": data}

    async def healthz(self) -> dict:
        return {"status": "ok"}

    async def readyz(self) -> JSONResponse:
        """Ready when Redis answers and every served model has a live worker."""
        try:
            await asyncio.wait_for(self.redis.ping(), 2.0)
        except (TimeoutError, aioredis.RedisError) as exc:
            return JSONResponse({"status": "unready", "redis": str(exc)}, status_code=503)
        workers = {name: await alive_workers(self.redis, name) for name in await served_models(self.redis)}
        ready = bool(workers) and all(workers.values())
        return JSONResponse({"status": "ready" if ready else "unready", "redis": "ok", "workers": workers},
                            status_code=200 if ready else 503)

    async def load(self, model: str = Query(..., max_length=256)) -> dict:
        """What an autoscaler reads (KEDA's metrics-api scaler in infra/k8s): a served model's requests in flight
        and its live workers."""
        if model not in await served_models(self.redis):
            raise RequestError(p.ErrorBody(message=f"The model '{model}' does not exist", param="model",
                                           code="model_not_found", status=404))
        return {"model": model, "in_flight": await in_flight(self.redis, model, self.settings.request_timeout_s),
                "workers": await alive_workers(self.redis, model)}

    async def redis_error(self, request: Request, exc: aioredis.RedisError) -> JSONResponse:
        return _error_response(redis_unavailable(exc), {"Retry-After": str(self.settings.retry_after_s)})

    async def prometheus(self) -> PlainTextResponse:
        return PlainTextResponse(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    return _error_response(exc.error, exc.headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (404 for an unknown path, 405 with `Allow`, 400 for a malformed form)."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    headers = {**(exc.headers or {}), **({"Allow": _allowed(request)} if exc.status_code == 405 else {})}
    return _error_response(p.ErrorBody(message=str(exc.detail), status=exc.status_code, type=kind), headers)


def _allowed(request: Request) -> str:
    """Every method of the request's path: Starlette's 405 names only the first route's, and a path may have a
    route per method (GET and POST /v1/batches)."""
    return ", ".join(sorted({method for route in request.app.router.routes if isinstance(route, Route)
                             and route.matches(request.scope)[0] is Match.PARTIAL for method in route.methods}))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's own 422 (a query or path parameter of the wrong type) as OpenAI's 400 naming it."""
    first = exc.errors()[0]
    param = param_name(first["loc"][1:])  # loc starts with "query" / "path"
    return _error_response(p.ErrorBody(message=f"{param}: {first['msg']}", param=param, code="invalid_value"))


def create_app(redis: aioredis.Redis, settings: GatewaySettings, tiers: RouterSettings,
               stream_settings: StreamSettings, default_cache_mode: p.CacheMode = "off",
               prices: PriceTable | None = None, sla: SlaPolicy | None = None,
               submit_batch: Callable[[str], Awaitable[None]] | None = None,
               journal: DeliveryJournal | UnjournaledDeliveries | None = None) -> FastAPI:
    """`prices`: the table budgets are estimated with (the ledger's); None: the shipped default.
    `sla`: the SLA classes requests may name; None: the default ones. `submit_batch(batch_id)`: starts the job
    that runs a new batch (services/jobs/tasks.py `celery_submitter`); None: batches are recorded, never run.
    `journal`: where what each client got is kept across a crash (`gateway.delivery_journal`); None: nowhere."""
    gateway = Gateway(redis, settings, tiers, stream_settings, default_cache_mode, prices, sla, journal)
    app = FastAPI(title="tokenfleet gateway", on_startup=[gateway.start])
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                       max_bytes_by_path={"/v1/files": MAX_FILE_BYTES + (1 << 20)})  # + the multipart envelope
    app.add_middleware(RequestStamp, metrics=gateway.metrics)  # outermost: it counts the 413s too
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(aioredis.RedisError, gateway.redis_error)
    batches = Batches(redis, gateway.authenticated, submit_batch, settings.batch_completion_window_s)
    routes = [("POST", "/v1/chat/completions", gateway.chat_completions),
              ("POST", "/v1/completions", gateway.completions),
              ("GET", "/v1/models", gateway.models),
              ("POST", "/v1/files", batches.upload_file),
              ("GET", "/v1/files/{file_id}", batches.get_file),
              ("GET", "/v1/files/{file_id}/content", batches.file_content),
              ("POST", "/v1/batches", batches.create_batch),
              ("GET", "/v1/batches", batches.list_batches),
              ("GET", "/v1/batches/{batch_id}", batches.get_batch),
              ("POST", "/v1/batches/{batch_id}/cancel", batches.cancel_batch),
              ("GET", "/healthz", gateway.healthz),
              ("GET", "/readyz", gateway.readyz),
              ("GET", "/load", gateway.load),
              ("GET", "/metrics", gateway.prometheus)]
    for method, path, handler in routes:  # each documented as it behaves: gateway/openapi.py
        app.add_api_route(path, handler, methods=[method], **openapi.operation(method, path))
    openapi.install(app, gateway.sla.classes)
    app.state.gateway = gateway
    return app
