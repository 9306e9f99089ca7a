"""The finance API, served by the accounting service: the ledger's rows (JSON pages or a CSV export) and cost
and goodput reports. Bearer API keys as at the gateway: a tenant's key (tenant = the key's name) sees only its
own rows; an admin key (`"admin": true` in its record) sees every tenant's and may filter by one.

Handlers are thin: they check the caller and the query, then call `services.accounting.reports`. They are
plain functions, so FastAPI runs the blocking database work in its thread pool, off the event loop."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import Engine
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.accounting import dashboard, reports
from services.base import protocol as p
from services.openai_api.schemas import RequestError
from services.tenancy.auth import authenticate

DEFAULT_REPORT_WINDOW = timedelta(days=1)  # a report without start or end covers the day up to now
MAX_PAGE = 1000


@dataclass(frozen=True)
class Finance:
    """What the handlers share, kept on `app.state` (no module globals)."""

    engine: Engine
    redis: aioredis.Redis


@dataclass(frozen=True)
class Caller:
    tenant: str
    admin: bool

    def scope(self, tenant: str | None) -> str | None:
        """The tenant whose rows to read (None: all). A tenant asking for another's is refused, not quietly
        given its own: a script that believes it reads tenant X's spend must not get Y's numbers."""
        if self.admin:
            return tenant
        if tenant is not None and tenant != self.tenant:
            raise RequestError(p.ErrorBody(message=f"this API key may read only tenant {self.tenant!r}'s ledger",
                                           type="permission_error", param="tenant", code="forbidden", status=403))
        return self.tenant


async def caller(request: Request) -> Caller:
    finance: Finance = request.app.state.finance
    key = await authenticate(finance.redis, request.headers.get("authorization"))
    if key is None:
        raise RequestError(p.ErrorBody(message="Incorrect or missing API key; pass it as 'Authorization: Bearer KEY'",
                                       code="invalid_api_key", status=401))
    return Caller(key.name, key.admin)


CallerDep = Annotated[Caller, Depends(caller)]
Tenant = Annotated[str | None, Query(min_length=1)]
Model = Annotated[str | None, Query(min_length=1)]


def _bad(param: str, message: str) -> RequestError:
    return RequestError(p.ErrorBody(message=message, param=param, code="invalid_value"))


def _ordered(start: datetime | None, end: datetime | None) -> None:
    if start is not None and end is not None and reports.utc(start) >= reports.utc(end):
        raise _bad("end", "end must be after start")


def _report_window(start: datetime | None, end: datetime | None) -> tuple[datetime, datetime]:
    end = reports.utc(end) if end is not None else datetime.now(UTC)
    start = reports.utc(start) if start is not None else end - DEFAULT_REPORT_WINDOW
    _ordered(start, end)
    return start, end


def ledger(request: Request, who: CallerDep, tenant: Tenant = None, model: Model = None,
           status: p.TaskStatus | None = None, start: datetime | None = None, end: datetime | None = None,
           limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100, after: Annotated[int | None, Query(ge=0)] = None,
           accept: Annotated[str | None, Header()] = None):
    """GET /v1/ledger: a keyset page of rows as JSON, or with `Accept: text/csv` every matching row as CSV."""
    _ordered(start, end)
    engine = request.app.state.finance.engine
    filters = reports.LedgerFilter(who.scope(tenant), model, status, start, end)
    if "text/csv" in (accept or ""):
        return StreamingResponse(reports.csv_chunks(reports.iter_rows(engine, filters)),
                                 media_type="text/csv; charset=utf-8",
                                 headers={"content-disposition": 'attachment; filename="ledger.csv"'})
    found = reports.page(engine, filters, limit, after)
    return {"object": "list", "data": [reports.plain(row) for row in found.rows], "has_more": found.has_more,
            "next_after": found.next_after}


def cost_report(request: Request, who: CallerDep, tenant: Tenant = None, model: Model = None,
                start: datetime | None = None, end: datetime | None = None,
                group_by: reports.Bucket | None = None) -> dict:
    """GET /v1/reports/cost: per tenant and model (and hour or day) over [start, end)."""
    start, end = _report_window(start, end)
    filters = reports.LedgerFilter(who.scope(tenant), model, None, start, end)
    groups = reports.cost(request.app.state.finance.engine, filters, group_by)
    return {"object": "report.cost", "start": start.isoformat(), "end": end.isoformat(), "group_by": group_by,
            "data": [reports.plain(group) for group in groups]}


def goodput_report(request: Request, who: CallerDep, tenant: Tenant = None, model: Model = None,
                   start: datetime | None = None, end: datetime | None = None) -> dict:
    """GET /v1/reports/goodput: per model and SLA class over [start, end)."""
    start, end = _report_window(start, end)
    filters = reports.LedgerFilter(who.scope(tenant), model, None, start, end)
    groups = reports.goodput(request.app.state.finance.engine, filters)
    return {"object": "report.goodput", "start": start.isoformat(), "end": end.isoformat(),
            "window_s": filters.window_s, "data": groups}


async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.error.openai(), status_code=exc.error.status, headers=exc.headers)


async def _invalid_query(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 as OpenAI's 400, naming the first bad parameter."""
    first = exc.errors()[0]
    param = str(first["loc"][-1]) if first.get("loc") else None
    error = p.ErrorBody(message=f"{param}: {first['msg']}" if param else first["msg"], param=param,
                        code="invalid_value")
    return JSONResponse(error.openai(), status_code=400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    error = p.ErrorBody(message=str(exc.detail), type=kind, status=exc.status_code)
    return JSONResponse(error.openai(), status_code=exc.status_code, headers=exc.headers)


def create_finance_app(engine: Engine, redis: aioredis.Redis, metrics: CollectorRegistry | None = None) -> FastAPI:
    """The app; the caller owns (and closes) the engine and the Redis client. `metrics`: served at /metrics."""
    app = FastAPI(title="tokenfleet finance")
    if metrics is not None:
        app.add_api_route("/metrics", lambda: PlainTextResponse(generate_latest(metrics),
                                                                media_type=CONTENT_TYPE_LATEST), methods=["GET"])
    app.state.finance = Finance(engine, redis)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _invalid_query)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/healthz", lambda: {"status": "ok"}, methods=["GET"])  # liveness (infra/k8s)
    app.add_api_route("/v1/ledger", ledger, methods=["GET"])
    app.add_api_route("/v1/reports/cost", cost_report, methods=["GET"])
    app.add_api_route("/v1/reports/goodput", goodput_report, methods=["GET"])
    dashboard.mount(app)
    return app
