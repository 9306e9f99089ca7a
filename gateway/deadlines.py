"""A request's deadline: how long the client will wait, from the headers it sends.

`x-request-timeout` (seconds) bounds any request. The `openai` SDKs send their read timeout as
`x-stainless-read-timeout`: for a response not streamed, no byte comes before the whole of it, so that is how long
the client waits for it; a stream's read timeout bounds only the gaps between its chunks, and sets no deadline."""

from __future__ import annotations

import math

from starlette.datastructures import Headers

from services.base import protocol as p
from services.openai_api.schemas import RequestError

TIMEOUT_HEADER = "x-request-timeout"
SDK_READ_TIMEOUT_HEADER = "x-stainless-read-timeout"


def client_timeout(headers: Headers, stream: bool) -> float | None:
    """Seconds the client will wait for the response, if it says; a malformed `x-request-timeout` is a 400 (the
    SDK's own header, which a client does not write, is ignored when malformed)."""
    if (ours := headers.get(TIMEOUT_HEADER)) is not None:
        seconds = _seconds(ours)
        if seconds is None:
            raise RequestError(p.ErrorBody(message=f"{TIMEOUT_HEADER} must be a positive number of seconds",
                                           param=TIMEOUT_HEADER, code="invalid_value"))
        return seconds
    if not stream and (sdk := headers.get(SDK_READ_TIMEOUT_HEADER)) is not None:
        return _seconds(sdk)
    return None


def _seconds(text: str) -> float | None:
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if seconds > 0 and math.isfinite(seconds) else None
