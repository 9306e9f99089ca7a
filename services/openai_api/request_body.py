"""Request bodies read defensively: refused by size before they are read whole (413), and refused as a 400
naming the field when they hold what no handler could use — a non-finite number (JSON's `Infinity`/`NaN`, or
`1e999`), an integer past 64 bits, a lone UTF-16 surrogate, nesting past `MAX_DEPTH` — before any validation,
queueing or tokenizing sees them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from services.base import protocol as p
from services.openai_api.schemas import RequestError, param_name

MAX_DEPTH = 32  # OpenAI's request bodies nest a handful of levels (messages[].content[].text)
MAX_INT_DIGITS = 20  # past int64 either way; Python refuses over 4,300 digits with a ValueError of its own


@dataclass(frozen=True)
class _Unusable:
    """Stands in for a number json.loads would otherwise return, so the walk can name where it sat."""

    literal: str
    why: str


def _float(literal: str) -> float | _Unusable:
    value = float(literal)
    return value if math.isfinite(value) else _Unusable(literal, "is not a finite number")


def _int(literal: str) -> int | _Unusable:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        return _Unusable(literal[:24] + "…", "is out of range")
    return int(literal)


def _refuse(message: str, param: str | None) -> RequestError:
    return RequestError(p.ErrorBody(message=message, param=param, code="invalid_value"))


def load_json(raw: bytes | str) -> Any:
    """The parsed body; `RequestError` (400) when it is not JSON or holds something unusable."""
    try:
        obj = json.loads(raw, parse_float=_float, parse_int=_int, parse_constant=lambda c: _Unusable(c, "is not a "
                                                                                                   "finite number"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _refuse(f"could not parse the JSON body: {exc}", None) from None
    except RecursionError:
        raise _refuse(f"the JSON body nests deeper than {MAX_DEPTH} levels", None) from None
    _check(obj)
    return obj


def _check(obj: Any) -> None:
    """An iterative walk (a recursive one is what a deep body would break)."""
    pending = [(obj, ())]
    while pending:
        value, path = pending.pop()
        if len(path) > MAX_DEPTH:
            raise _refuse(f"the JSON body nests deeper than {MAX_DEPTH} levels", param_name(path[:MAX_DEPTH]))
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                pending.append((item, (*path, key)))
        elif isinstance(value, list):
            pending.extend((item, (*path, i)) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, _Unusable):
            name = param_name(path)
            raise _refuse(f"{name or 'the body'}: {value.literal} {value.why}", name)


def _check_text(text: str, path: tuple) -> None:
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            name = param_name(path)
            raise _refuse(f"{name or 'the body'}: a string holds a lone UTF-16 surrogate (not valid Unicode)",
                          name) from None


# Request headers past this (all of them, names and values) get a 431. uvicorn's own bound (h11's 16 KiB for the
# request line and headers) answers a plain-text 400 past that.
MAX_HEADER_BYTES = 8 << 10


class BodyLimit:
    """ASGI middleware: a body over its path's limit is answered 413 (OpenAI's error object) before it is
    read whole — by its Content-Length when it declares one, else as its chunks arrive; headers over
    `MAX_HEADER_BYTES` are answered 431."""

    def __init__(self, app, max_bytes: int, max_bytes_by_path: dict[str, int]):
        self.app, self.max_bytes, self.max_bytes_by_path = app, max_bytes, max_bytes_by_path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header_bytes = sum(len(name) + len(value) for name, value in scope["headers"])
        if header_bytes > MAX_HEADER_BYTES:
            return await _answer(send, 431, f"the request headers are over {MAX_HEADER_BYTES} bytes",
                                 "request_header_fields_too_large")
        limit = self.max_bytes_by_path.get(scope["path"], self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _too_large(send, limit)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _BodyTooLarge:
            if not started:
                await _too_large(send, limit)


class _BodyTooLarge(Exception):
    pass


async def _too_large(send, limit: int) -> None:
    await _answer(send, 413, f"the request body is over {limit} bytes", "request_too_large")


async def _answer(send, status: int, message: str, code: str) -> None:
    body = p.dumps(p.ErrorBody(message=message, code=code, status=status).openai()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
