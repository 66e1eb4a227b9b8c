"""The Serve application: an OpenAI router (FastAPI ingress) over a decode pool, which asks a
prefill pool for each prompt's KV (disaggregated) or prefills locally (colocated).

    serve deploy configs/serve.yaml      # import_path: cluster.router.app:build_app

    HTTP ─▶ Router ── DecodeRouter ──▶ DecodePool ── PrefillRouter ──▶ PrefillPool
              ▲        (free blocks,      │  ▲          (queued prompt      │
              │         load)             │  └── KV via the connector ◀────┘
              └──── token deltas (streamed; several tokens per chunk when behind)

Pool sizes, autoscaling and actor options come from the YAML `deployments:` entries named
Router, PrefillPool and DecodePool; model, connector, cache and scheduler from the app's args.

(No `from __future__ import annotations` here: Serve's class-based FastAPI views need real
annotation objects to see that `request: Request` is the request, not a query parameter.)
"""


import asyncio
import contextvars
import hmac
import json
import os
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from cluster.config import AppConfig
from cluster.decode.deployment import DecodeDeployment
from cluster.decode.server import PrefillFailed
from cluster.engine.tokenizer import Tokenizer
from cluster.kvtransfer.errors import KVTransferError
from cluster.models.architecture import Architecture
from cluster.models.loader import resolve_model_path
from cluster.outputs import TokenDelta
from cluster.prefill.deployment import PrefillDeployment
from cluster.router.migration import migrating
from cluster.router.openai_server import OpenAIServer
from cluster.router.protocol import APIError
from cluster.router.request_routers import ROUTING_STATS_PERIOD_S
from cluster.router.stats_board import board
from cluster.sampling_params import SamplingParams

POOL_WATCH_PERIOD_S = 1.0
MAX_HEADERS = 64            # request header count; more is refused with 431
MAX_HEADER_BYTES = 8 << 10  # all header names and values together

api = FastAPI(title="Tandem", docs_url=None, redoc_url=None, openapi_url=None)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own 404 (no such route) and 405 (wrong method), in OpenAI's shape."""
    message = {404: "no such route", 405: "method not allowed on this route"}.get(exc.status_code, "bad request")
    return error_response(APIError(exc.status_code, message))


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


api.add_middleware(HeaderLimits)


# Everything the Router's routes use is defined above the class: `serve.ingress` freezes a
# pickled copy of the FastAPI app (its routes bound to these methods, with the module globals
# that exist at that moment) when the decorator runs; later names are missing in the replica.
class _ClosingStream(StreamingResponse):
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


def _replica_lost(exc: BaseException) -> bool:
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


def _as_api_error(exc: BaseException) -> APIError:
    from ray.serve.exceptions import BackPressureError

    if isinstance(exc, BackPressureError):
        return APIError(503, "the server is at capacity; retry later", type_="server_error",
                        headers={"Retry-After": "1"})
    if isinstance(exc, (PrefillFailed, KVTransferError)):
        return APIError(503, f"the prompt could not be prefilled: {type(exc).__name__}", type_="server_error",
                        headers={"Retry-After": "1"})
    if isinstance(exc, ValueError):  # the engine's own checks (prompt, limits)
        return APIError(400, str(exc)[:500])
    if _replica_lost(exc):
        return APIError(503, "a replica was lost; retry", type_="server_error", headers={"Retry-After": "1"})
    return APIError(500, f"internal error: {type(exc).__name__}", type_="internal_error")


@serve.deployment(name="Router", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class RouterDeployment:
    def __init__(self, config: dict[str, Any], decode: DeploymentHandle) -> None:
        self.config = AppConfig.from_args(config)
        model = self.config.engine.model
        path = resolve_model_path(model.model, model.cache_dir)
        arch = Architecture.from_folder(path)
        max_len = min(x for x in (model.max_model_len or arch.max_position_embeddings,
                                  arch.sliding_window or 1 << 62))
        self.decode = decode.options(stream=True)
        self.stats_handle = decode
        self.api_key = self.config.api_key or os.environ.get("TANDEM_API_KEY") or None
        self.openai = OpenAIServer(self.config.served_model_name or path.name, Tokenizer(path), max_len,
                                   self._generate, map_error=_as_api_error)
        self.app_name = serve.get_replica_context().app_name
        self.active = 0  # requests in flight here, streams until their last byte
        self.migrations = 0  # streams moved to another decode replica after theirs died
        self.pools = ("DecodePool",) if self.config.mode == "colocated" else ("DecodePool", "PrefillPool")
        self.running: dict[str, int] | None = None  # RUNNING replicas per pool, as Serve reports them
        self._watcher: asyncio.Task | None = None

    async def _generate(self, request_id: str, prompt_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[list[TokenDelta]]:
        def start(rid: str, ids: list[int], p: SamplingParams) -> Any:
            # A fresh context: Serve tags handle calls with the HTTP request's internal id, and
            # the n concurrent children of one request must not share it (their streams collide).
            return contextvars.Context().run(self.decode.generate.remote, rid, ids, p)

        async for deltas in migrating(start, request_id, prompt_ids, params,
                                      max_migrations=self.config.max_migrations, is_lost=_replica_lost,
                                      on_migrate=self._count_migration):
            yield deltas

    def _count_migration(self) -> None:
        self.migrations += 1

    # -- routes ------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._auth(request)
        return JSONResponse(self.openai.models())

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._serve(request, self.openai.chat)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, self.openai.completions)

    @api.get("/debug/stats")
    async def debug_stats(self, request: Request) -> Response:
        """Every live replica's engine and transfer counters (blocks in use, running, ...)."""
        self._auth(request)
        replicas = await board(self.app_name).read.remote()
        return JSONResponse({"replicas": sorted(replicas, key=lambda r: (r["pool"], r["replica"]))})

    # -- helpers -----------------------------------------------------------------------
    async def _serve(self, request: Request, handler) -> Response:
        limit = self.config.max_concurrent_requests
        if limit is not None and self.active >= limit:
            return error_response(APIError(503, "the server is at capacity; retry later", type_="server_error",
                                           code="overloaded", headers={"Retry-After": "1"}))
        empty = await self._empty_pool()
        if empty is not None:  # a call into it would wait for a replica that may never come
            return error_response(APIError(503, f"no {empty} replica is running; retry later", type_="server_error",
                                           code="pool_unavailable", headers={"Retry-After": "1"}))
        self.active += 1
        streaming = False
        try:
            self._auth(request)
            body = await self._body(request)
            result = await handler(body, self._timeout(request))
            if isinstance(result, dict):
                return JSONResponse(result)
            streaming = True
            return _ClosingStream(result, self._release)
        except APIError as exc:
            return error_response(exc)
        except Exception as exc:
            return error_response(_as_api_error(exc))
        finally:
            if not streaming:
                self._release()

    def _release(self) -> None:
        self.active -= 1

    async def _empty_pool(self) -> str | None:
        """A pool with no RUNNING replica (as of the last look, at most POOL_WATCH_PERIOD_S old)."""
        if self._watcher is None or self._watcher.done():
            if self.running is None:
                await self._look_at_pools()
            self._watcher = asyncio.get_running_loop().create_task(self._watch_pools())
        running = self.running
        if running is None:  # the controller did not answer: let the request through
            return None
        return next((p for p in self.pools if running.get(p, 0) == 0), None)

    async def _watch_pools(self) -> None:
        while True:
            await asyncio.sleep(POOL_WATCH_PERIOD_S)
            await self._look_at_pools()

    async def _look_at_pools(self) -> None:
        try:
            status = await asyncio.to_thread(serve.status)
            app = status.applications.get(self.app_name)
            if app is not None:
                self.running = {name: d.replica_states.get("RUNNING", 0) for name, d in app.deployments.items()}
        except Exception:  # the controller restarting: keep the last view
            pass

    def _timeout(self, request: Request) -> float | None:
        """The app's request_timeout_s, or the client's shorter X-Request-Timeout (seconds)."""
        limit = self.config.request_timeout_s
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

    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "invalid or missing API key", type_="authentication_error",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> Any:
        limit = self.config.max_request_bytes
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


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve's app builder: validates `args` (unknown keys are errors) and wires the pools."""
    config = AppConfig.from_args(args)
    raw = dict(args or {})
    stats_period = {"request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}
    decode_router = RequestRouterConfig(request_router_class="cluster.router.request_routers:DecodeRouter",
                                        **stats_period)
    if config.mode == "colocated":
        decode = DecodeDeployment.options(request_router_config=decode_router).bind(raw, None)
    else:
        prefill_router = RequestRouterConfig(request_router_class="cluster.router.request_routers:PrefillRouter",
                                             **stats_period)
        prefill = PrefillDeployment.options(request_router_config=prefill_router).bind(raw)
        decode = DecodeDeployment.options(request_router_config=decode_router).bind(raw, prefill)
    return RouterDeployment.bind(raw, decode)
