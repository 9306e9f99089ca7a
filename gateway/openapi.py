"""The gateway's OpenAPI document, as the handlers really behave. They read their bodies themselves (raw
`Request`, `load_json`, then `parse`), so FastAPI sees no body, and its validation errors are answered 400
rather than 422: `operation(method, path)` declares each route's body, answers and error codes, and `install`
adds the request models' JSON schemas and the shared objects to the document's components."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, get_args

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from services.base import protocol as p
from services.batch.store import ENDPOINTS
from services.openai_api.request_body import MAX_INT_DIGITS
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest)
_NULLABLE_TEXT = {"type": ["string", "null"]}
_TIMESTAMP = {"type": "integer"}
_TIMESTAMP_OR_NULL = {"type": ["integer", "null"]}


def _ref(name: str) -> dict:
    return {"$ref": REF.format(model=name)}


def _object(required: Iterable[str], **properties: Any) -> dict:
    return {"type": "object", "required": list(required), "properties": properties}


_CHOICES = {"type": "array", "items": {"type": "object", "required": ["index"], "properties": {
    "index": {"type": "integer"}, "finish_reason": _NULLABLE_TEXT}}}


def _generated(obj: str) -> dict:
    return _object(["id", "object", "created", "model", "choices"], id={"type": "string"}, object={"const": obj},
                   created=_TIMESTAMP, model={"type": "string"}, choices=_CHOICES, usage={"type": "object"})


_BATCH_STATUS = ["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                 "cancelled"]
_BATCH_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
                "expired_at", "cancelling_at", "cancelled_at")

# Objects shared by the operations (the request models' schemas join them in `install`).
COMPONENTS: dict[str, dict] = {
    "Error": _object(["message", "type", "param", "code"], message={"type": "string"}, type={"type": "string"},
                     param=_NULLABLE_TEXT, code=_NULLABLE_TEXT),
    "ErrorResponse": {**_object(["error"], error=_ref("Error")), "description": "OpenAI's error object"},
    "ChatCompletion": _generated("chat.completion"),
    "Completion": _generated("text_completion"),
    "ModelList": _object(["object", "data"], object={"const": "list"}, data={"type": "array", "items": _object(
        ["id", "object", "created", "owned_by"], id={"type": "string"}, object={"const": "model"},
        created=_TIMESTAMP, owned_by={"type": "string"}, max_model_len={"type": "integer"},
        tier={"type": "string"})}),
    "FileObject": _object(["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
                          id={"type": "string"}, object={"const": "file"}, bytes={"type": "integer"},
                          created_at=_TIMESTAMP, filename={"type": "string"}, purpose={"type": "string"},
                          status={"type": "string"}, status_details=_NULLABLE_TEXT),
    "Batch": _object(["id", "object", "endpoint", "input_file_id", "completion_window", "status", "request_counts",
                      *_BATCH_TIMES],
                     id={"type": "string"}, object={"const": "batch"}, endpoint={"enum": list(ENDPOINTS)},
                     input_file_id={"type": "string"}, completion_window={"const": "24h"},
                     status={"enum": _BATCH_STATUS}, output_file_id=_NULLABLE_TEXT, error_file_id=_NULLABLE_TEXT,
                     errors={"type": ["object", "null"]}, metadata={},
                     request_counts=_object(["total", "completed", "failed"], total={"type": "integer"},
                                            completed={"type": "integer"}, failed={"type": "integer"}),
                     **{name: _TIMESTAMP if name in ("created_at", "expires_at") else _TIMESTAMP_OR_NULL
                        for name in _BATCH_TIMES}),
    "BatchList": _object(["object", "data", "first_id", "last_id", "has_more"], object={"const": "list"},
                         data={"type": "array", "items": _ref("Batch")}, first_id=_NULLABLE_TEXT,
                         last_id=_NULLABLE_TEXT, has_more={"type": "boolean"}),
    "CreateBatchRequest": _object(["input_file_id", "endpoint", "completion_window"],
                                  input_file_id={"type": "string", "description": "a file uploaded with purpose "
                                                 "\"batch\"; an unknown one is a 400"},
                                  endpoint={"enum": list(ENDPOINTS)}, completion_window={"const": "24h"},
                                  metadata={"description": "kept with the batch as given"}),
    "FileUpload": _object(["file", "purpose"], file={"type": "string", "format": "binary", "description":
                                                      "JSONL: one request a line (custom_id, method, url, body)"},
                          purpose={"const": "batch"}),
    # A value the API keeps or ignores as given (a message's extra fields): any JSON that `load_json` takes,
    # which refuses anywhere in a body an integer past MAX_INT_DIGITS digits (and nesting past MAX_DEPTH).
    "JsonValue": {"anyOf": [{"type": ["string", "boolean", "null"]},
                            {"type": "integer", "minimum": 1 - 10**MAX_INT_DIGITS, "maximum": 10**MAX_INT_DIGITS - 1},
                            {"type": "number", "not": {"type": "integer"}},
                            {"type": "array", "items": _ref("JsonValue")},
                            {"type": "object", "additionalProperties": _ref("JsonValue")}]},
    "Health": _object(["status"], status={"type": "string"}, redis={"type": "string"},
                      workers={"type": "object", "additionalProperties": {"type": "integer"}}),
    "Load": _object(["model", "in_flight", "workers"], model={"type": "string"}, in_flight={"type": "integer"},
                    workers={"type": "integer"}),
}

SECURITY_SCHEMES = {"bearer": {"type": "http", "scheme": "bearer", "description": "an API key"}}

_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
_ERRORS = {
    400: "the request is malformed; `param` names the offending field",
    401: "the API key is missing or unknown",
    404: "no such model, file or batch (another tenant's ids are unknown too)",
    413: "the request body is over the size limit",
    431: "the request headers are over 8 KiB",
    429: "a queue is full, or the key's rate limit or budget is reached",
    500: "the worker failed the request, or its reply stream ended early",
    503: "no live worker of the model, the accounting backlog is too long, or Redis is unavailable",
    504: "no reply from a worker within the request timeout",
}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _errors(statuses: Iterable[int]) -> dict:
    """`statuses`, and the 431 any route may answer (`services/openai_api/request_body.py`)."""
    return {status: {"description": _ERRORS[status], "content": _json(_ref("ErrorResponse")),
                     **({"headers": _RETRY_AFTER} if status in (429, 503) else {})} for status in (*statuses, 431)}


class JsonlResponse(Response):
    media_type = "application/jsonl"


_STRING: dict = {}  # adds nothing to FastAPI's own: `response_class`'s media type, a string


def _header(name: str, description: str, schema: dict | None = None) -> dict:
    return {"name": name, "in": "header", "required": False, "description": description,
            "schema": schema or {"type": "string"}}


_GENERATION_HEADERS = [
    _header("Idempotency-Key", "a repeat within its TTL returns the first request's response, never a second run"),
    _header("X-Tokenfleet-Cache", "the response caches for this request, unless the body's `cache` names them",
            {"enum": list(get_args(p.CacheMode))}),
    _header("traceparent", "W3C trace context; an invalid one starts a new trace"),
]
_GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503, 504)
_READ_ERRORS = (401, 404, 503)


def _operation(summary: str, ok: dict, errors: Iterable[int] = (), body: dict | None = None,
               parameters: list[dict] | None = None, secured: bool = True,
               response_class: type[Response] | None = None) -> dict:
    """`add_api_route`'s keywords: `responses` (the 200 refines FastAPI's own, whose media type is
    `response_class`'s, JSON when None: the handlers build their own responses, so it only documents) and
    `openapi_extra`."""
    extra: dict[str, Any] = {"security": [{"bearer": []}]} if secured else {}
    if body is not None:
        extra["requestBody"] = {"required": True, "content": body}
    if parameters:
        extra["parameters"] = parameters
    return {"summary": summary, "responses": {200: {"description": "OK", "content": ok}, **_errors(errors)},
            "openapi_extra": extra, **({"response_class": response_class} if response_class else {})}


def _generation(summary: str, request: str, response: str) -> dict:
    return _operation(summary, {**_json(_ref(response)), "text/event-stream": {
        "schema": {"type": "string", "description": "with `stream`: server-sent events, ending `data: [DONE]`"}}},
        _GENERATION_ERRORS, _json(_ref(request)), _GENERATION_HEADERS)


_BATCH_LINE = ('{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "auto", '
               '"messages": [{"role": "user", "content": "Hello"}]}}\n')
_OPERATIONS = {
    ("POST", "/v1/chat/completions"): _generation("Creates a chat completion", "ChatCompletionRequest",
                                                  "ChatCompletion"),
    ("POST", "/v1/completions"): _generation("Creates a completion", "CompletionRequest", "Completion"),
    ("GET", "/v1/models"): _operation("Lists the served models", _json(_ref("ModelList")), (401, 503)),
    ("POST", "/v1/files"): _operation(
        "Uploads a batch input file", _json(_ref("FileObject")), (400, 401, 413, 503),
        {"multipart/form-data": {"schema": _ref("FileUpload"), "encoding": {"file": {"contentType":
                                                                                     "application/jsonl"}},
                                 "example": {"file": _BATCH_LINE, "purpose": "batch"}}}),
    ("GET", "/v1/files/{file_id}"): _operation("A file's object", _json(_ref("FileObject")), _READ_ERRORS),
    ("GET", "/v1/files/{file_id}/content"): _operation("A file's content", _STRING, _READ_ERRORS,
                                                       response_class=JsonlResponse),
    ("POST", "/v1/batches"): _operation(
        "Creates a batch", _json(_ref("Batch")), (400, 401, 413, 503),
        _json(_ref("CreateBatchRequest"))),
    ("GET", "/v1/batches"): _operation("Lists the key's batches, newest first", _json(_ref("BatchList")),
                                       (400, 401, 503)),
    ("GET", "/v1/batches/{batch_id}"): _operation("A batch", _json(_ref("Batch")), _READ_ERRORS),
    ("POST", "/v1/batches/{batch_id}/cancel"): _operation("Cancels a batch", _json(_ref("Batch")), _READ_ERRORS),
    ("GET", "/healthz"): _operation("Liveness", _json(_ref("Health")), secured=False),
    ("GET", "/readyz"): _operation("Ready when Redis answers and every served model has a live worker",
                                   _json(_ref("Health")), secured=False),
    ("GET", "/load"): _operation("A served model's requests in flight and live workers, for autoscalers",
                                 _json(_ref("Load")), (400, 404, 503), secured=False),
    ("GET", "/metrics"): _operation("Prometheus metrics", _STRING, secured=False, response_class=PlainTextResponse),
}
# Not ready is a probe's answer, not an OpenAI error: the same object as 200.
_OPERATIONS["GET", "/readyz"]["responses"][503] = {"description": "not ready", "content": _json(_ref("Health"))}


def operation(method: str, path: str) -> dict:
    """The keywords for `app.add_api_route(path, ..., methods=[method], **operation(method, path))`."""
    return copy.deepcopy(_OPERATIONS[method, path])


def request_schemas(sla_classes: Iterable[str]) -> dict[str, dict]:
    """The request models' JSON schemas (and the models they use), as `parse` reads bodies: a null field is
    the field's default, and `sla` is one of the deployment's classes."""
    schemas: dict[str, dict] = {}
    for model in REQUEST_MODELS:
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        required = set(schema.get("required", ()))
        schema["properties"] = {name: prop if name in required else _nullable(prop)
                                for name, prop in schema["properties"].items()}
        if sla_classes:
            schema["properties"]["sla"]["anyOf"][0] = {"enum": sorted(sla_classes)}
        schemas[model.__name__] = schema
    for schema in schemas.values():
        _bound_extra_fields(schema)
    return schemas


def _bound_extra_fields(schema: Any) -> None:
    """An object schema that takes any other field takes a `JsonValue` there."""
    if isinstance(schema, list):
        for item in schema:
            _bound_extra_fields(item)
    elif isinstance(schema, dict):
        if schema.get("type") == "object" and schema.get("additionalProperties", True) is True:
            schema["additionalProperties"] = _ref("JsonValue")
        for value in schema.values():
            _bound_extra_fields(value)


def _nullable(prop: dict) -> dict:
    if {"type": "null"} in prop.get("anyOf", ()):
        return prop
    outer = {key: prop.pop(key) for key in ("title", "default", "description") if key in prop}
    return {**outer, "anyOf": [prop, {"type": "null"}]}


def install(app: FastAPI, sla_classes: Iterable[str]) -> None:
    """`app.openapi()` as the routes declared it, plus the shared components, less FastAPI's 422 (its
    validation errors are answered 400: gateway/app.py `_validation_error`)."""
    generate, sla_classes = app.openapi, list(sla_classes)

    def document() -> dict:
        if app.openapi_schema is None:
            doc = generate()
            for operations in doc["paths"].values():
                for op in operations.values():
                    op["responses"].pop("422", None)
            components = doc.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            schemas.update({**COMPONENTS, **request_schemas(sla_classes)})
            components["securitySchemes"] = SECURITY_SCHEMES
        return app.openapi_schema

    app.openapi = document
