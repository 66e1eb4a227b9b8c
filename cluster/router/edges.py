"""The router's HTTP edge, apart from routing: OpenAI-shaped error responses (and what each
failure from the pools becomes), header and body limits, the client's deadline, and SSE
responses that clean up however they end.
(Imported by cluster/router/app.py before its Serve ingress class: see the note there.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import ray
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.engine.outputs import ChannelClosed
from cluster.kvtransfer.handoff import PrefillFailed
from cluster.kvtransfer.errors import KVTransferError
from cluster.router.errors import APIError

MAX_HEADERS = 64            # request header count; more is refused with 431
MAX_HEADER_BYTES = 8 << 10  # all header names and values together


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class HeaderLimits:
    """Plain ASGI (streams pass through untouched): too many or too large headers → 431."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = scope.get("headers") or []
            if len(headers) > MAX_HEADERS or sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES:
                err = APIError(431, f"request headers exceed {MAX_HEADERS} fields or {MAX_HEADER_BYTES} bytes")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(request: Any, limit: int) -> Any:
    """The body as JSON: application/json, at most `limit` bytes (checked as it arrives)."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(415, "the body must be application/json")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body exceeds {limit} bytes")
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise APIError(413, f"the body exceeds {limit} bytes")
    try:
        return json.loads(bytes(data).decode("utf-8", errors="strict"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise APIError(400, "the body is not valid JSON") from None


def request_timeout(request: Any, limit: float | None) -> float | None:
    """The app's request_timeout_s (`limit`), or the client's shorter X-Request-Timeout (seconds)."""
    asked = request.headers.get("x-request-timeout")
    if asked is None:
        return limit
    try:
        value = float(asked)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise APIError(400, "X-Request-Timeout must be a positive number of seconds", param="X-Request-Timeout")
    return value if limit is None else min(value, limit)


class ClosingStream(StreamingResponse):
    """An SSE response that, however it ends (done, client gone, cancelled before its first
    byte), closes its stream (aborting the request in the pools) and releases its slot."""

    def __init__(self, stream: Any, release: Any) -> None:
        super().__init__(stream, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream, self._release = stream, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            await asyncio.shield(self._stream.aclose())


def replica_lost(exc: BaseException) -> bool:
    """The decode replica is gone, or so is the channel its tokens came over (router/mux.py)."""
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ChannelClosed))


def as_api_error(exc: BaseException) -> APIError:
    from ray.serve.exceptions import BackPressureError

    if isinstance(exc, BackPressureError):
        return APIError(503, "the server is at capacity; retry later", type_="server_error",
                        headers={"Retry-After": "1"})
    if isinstance(exc, (PrefillFailed, KVTransferError)):
        return APIError(503, f"the prompt could not be prefilled: {type(exc).__name__}", type_="server_error",
                        headers={"Retry-After": "1"})
    if isinstance(exc, ValueError):  # the engine's own checks (prompt, limits)
        return APIError(400, str(exc)[:500])
    if replica_lost(exc):
        return APIError(503, "a replica was lost; retry", type_="server_error", headers={"Retry-After": "1"})
    return APIError(500, f"internal error: {type(exc).__name__}", type_="internal_error")
