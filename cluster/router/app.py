"""The Serve application: an OpenAI router (FastAPI ingress) over a decode pool, which asks a
prefill pool for each prompt's KV (disaggregated) or prefills locally (colocated).

    serve deploy configs/serve.yaml      # import_path: cluster.router.app:build_app

    HTTP, gRPC ─▶ Router ── DecodeRouter ──▶ DecodePool ── PrefillRouter ──▶ PrefillPool
                    ▲        (free blocks,      │  ▲          (queued prompt      │
                    │         load)             │  └── KV via the connector ◀────┘
                    └──── token deltas (a gRPC stream; several tokens per chunk when behind)

Pool sizes, autoscaling and actor options come from the YAML `deployments:` entries named
Router, PrefillPool and DecodePool; model, connector, cache and scheduler from the app's args.

(No `from __future__ import annotations` here: Serve's class-based FastAPI views need real
annotation objects to see that `request: Request` is the request, not a query parameter.)
"""

import asyncio
import contextvars
import hmac
import os
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Deployment
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from cluster import cpu_binding
from cluster.app_config import SHUTDOWN_POLL_S, AppConfig
from cluster.engine.tokenizer import Tokenizer
from cluster.models.architecture import Architecture
from cluster.models.default_model import resolve_model_path
from cluster.engine.outputs import TokenDelta
from cluster.router import grpc_api, tokenize_api
from cluster.router.migration import migrating
from cluster.router.mux import Mux
from cluster.router.edges import (ClosingStream, HeaderLimits, as_api_error, error_response, read_json,
                                  replica_lost, request_timeout)
from cluster.router.openai_server import OpenAIServer
from cluster.router.metrics import render as render_metrics
from cluster.router.errors import APIError
from cluster.router import request_log  # its ContextVar cannot be pickled: referenced via the module
from cluster.router.request_log import REQUEST_ID, RequestLog, configure_trace_logging
from cluster.router.request_routers import ROUTING_STATS_PERIOD_S
from cluster.stats_board import ask_board, post_forever
from cluster.sampling_params import SamplingParams

POOL_WATCH_PERIOD_S = 1.0
POOL_WATCH_IDLE_S = 10.0  # no request (nor /health) for this long: stop asking Serve (~4 ms of CPU a look)


def serving_request_id() -> str:
    """The id Serve's proxy gave the request being served (the one it hands back to the client)."""
    return serve.context._get_serve_request_context().request_id  # ray is pinned: see pyproject.toml


api = FastAPI(title="Tandem", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own 404 (no such route) and 405 (wrong method), in OpenAI's shape."""
    message = {404: "no such route", 405: "method not allowed on this route"}.get(exc.status_code, "bad request")
    return error_response(APIError(exc.status_code, message))


api.add_middleware(HeaderLimits)


def running_replicas(app_name: str) -> dict[str, int] | None:
    """Serve's replicas taking calls (RUNNING or RECOVERING) per deployment of the app; None
    when Serve or the app is not there. Read from the controller's details as the plain dict
    `serve.status()` parses: the parse into pydantic models pickles each deployment's request
    router class again, ~10 ms of the caller's CPU a look on the 2-core AVX-512 host against
    ~1 ms for the dict (the controller's own share, ~2.5-3 ms, the same either way)."""
    from ray.serve.context import _get_global_client  # (what serve.status() reads; Ray is pinned)

    client = _get_global_client(raise_if_no_controller_running=False)
    app = client.get_serve_details().get("applications", {}).get(app_name) if client is not None else None
    if app is None:
        return None
    taking = ("RUNNING", "RECOVERING")
    return {name: sum(getattr(r["state"], "value", r["state"]) in taking for r in d.get("replicas", ()))
            for name, d in app.get("deployments", {}).items()}


# Everything the Router's routes use is defined above the class: `serve.ingress` freezes a
# pickled copy of the FastAPI app (its routes bound to these methods, with the module globals
# that exist at that moment) when the decorator runs; later names are missing in the replica.
@serve.deployment(name="Router", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0},
                  graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
@serve.ingress(api)
class RouterDeployment:
    pool_watch_period_s, pool_watch_idle_s = POOL_WATCH_PERIOD_S, POOL_WATCH_IDLE_S

    def __init__(self, config: dict[str, Any], decode: DeploymentHandle) -> None:
        self.config = AppConfig.from_args(config)
        self.cpus = cpu_binding.bind("router", self.config.cpu_binding)  # off the decode replicas' cores
        model = self.config.engine.model
        path = resolve_model_path(model.model, model.cache_dir)
        arch = Architecture.from_folder(path)
        max_len = min(x for x in (model.max_model_len or arch.max_position_embeddings,
                                  arch.sliding_window or 1 << 62))
        self.decode = decode.options(stream=True, _by_reference=False)  # streams over gRPC: cheaper (docs/performance.md)
        # the token channels' batches (plain dataclasses of importable modules) in the standard
        # pickle, not Serve's default cloudpickle: ~2.3x less of the decode replica's event loop per
        # step, the loop whose GIL the engine thread waits for (docs/performance.md)
        self.channels = self.decode.options(response_serialization="pickle")
        self.stats_handle = decode
        self.api_key = self.config.api_key or os.environ.get("TANDEM_API_KEY") or None
        self.openai = OpenAIServer(self.config.served_model_name or path.name, Tokenizer(path), max_len,
                                   self._generate, map_error=as_api_error,
                                   scheduling_policy=self.config.engine.scheduler.scheduling_policy,
                                   read_ahead=not self.config.multiplexed_streams)
        ctx = serve.get_replica_context()
        self.app_name, self.replica_id = ctx.app_name, ctx.replica_id.unique_id
        self.active = 0  # requests in flight here, streams until their last byte
        self.log = RequestLog(self.replica_id)  # TTFT/e2e histograms, counters, per-request traces
        # one channel per decode replica carries each step's tokens of all our requests there
        self.mux = Mux(self._subscribe, self._cancel, self.log.counters) if self.config.multiplexed_streams else None
        configure_trace_logging()
        self._poster: asyncio.Task | None = None
        self.pools = ("DecodePool",) if self.config.mode == "colocated" else ("DecodePool", "PrefillPool")
        # per pool, replicas taking calls: RUNNING, or RECOVERING (a restarted controller re-adopting them)
        self.running: dict[str, int] | None = None
        self._watcher: asyncio.Task | None = None
        self._asked = 0.0  # monotonic time of the last request that asked for the view

    async def _generate(self, request_id: str, prompt_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[list[TokenDelta]]:
        def start(rid: str, ids: list[int], p: SamplingParams) -> Any:
            # A fresh context: Serve tags handle calls with the HTTP request's internal id, and
            # the n concurrent children of one request must not share it (their streams collide).
            if self.mux is None:
                return contextvars.Context().run(self.decode.generate.remote, rid, ids, p)
            self.mux.reopen()  # a burst after a pause: its channels on their way before its requests
            own = contextvars.Context().run(self.decode.generate.remote, rid, ids, p, mux=self.replica_id)
            return self.mux.stream(rid, own)

        moved = {"migrations": 0}

        def on_migrate() -> None:
            moved["migrations"] += 1
            self.log.counters["migrations"] += 1

        stream = migrating(start, request_id, prompt_ids, params, max_migrations=self.config.max_migrations,
                           is_lost=replica_lost, on_migrate=on_migrate)
        async for deltas in self.log.track(request_log.current_request_id.get(), request_id, stream, moved):
            yield deltas

    def _subscribe(self, replica: str) -> AsyncIterator[dict[str, list[TokenDelta]]]:
        """This router's channel on one decode replica (pinned there by `replica_id`)."""
        return contextvars.Context().run(self.channels.subscribe.remote, self.replica_id, replica_id=replica)

    async def _cancel(self, replica: str, request_id: str) -> None:
        """Abort a multiplexed request on its decode replica (pinned there by `replica_id`)."""
        await contextvars.Context().run(self.stats_handle.cancel.remote, request_id, replica_id=replica)

    # -- routes ------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> Response:
        """200 once every pool has a RUNNING replica (what `tandem up` and load balancers wait
        for); 503 naming the empty pool before that, or while one has none."""
        empty = await self._empty_pool()
        if empty is not None:
            return error_response(APIError(503, f"no {empty} replica is running", type_="server_error",
                                           code="pool_unavailable", headers={"Retry-After": "1"}))
        return Response(status_code=200)

    @api.get("/v1/models")
    @api.get("/v1/models/{model_id:path}")  # the SDK's models.retrieve
    async def models(self, request: Request, model_id: str | None = None) -> Response:
        self._auth(request)
        return JSONResponse(self.openai.models(model_id))

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._serve(request, self.openai.chat)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, self.openai.completions)

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """vLLM's: a prompt's (or a chat's) token ids as this server counts them; no pool is asked."""
        return await self._local(request, tokenize_api.tokenize)

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._local(request, tokenize_api.detokenize)

    @api.get("/debug/stats")
    async def debug_stats(self, request: Request) -> Response:
        """Every live pool replica's engine and transfer counters (blocks in use, running, ...)."""
        self._auth(request)
        replicas = [r for r in await ask_board(self.app_name, "read") if r.get("pool") in ("prefill", "decode")]
        return JSONResponse({"replicas": sorted(replicas, key=lambda r: (r["pool"], r["replica"]))})

    @api.get("/debug/requests/{request_id}")
    async def debug_request(self, request: Request, request_id: str) -> Response:
        """The traces of a request (its X-Request-Id), one per choice, whichever router served it."""
        self._auth(request)
        traces = self.log.traces.get(request_id) or await ask_board(self.app_name, "trace", request_id)
        if traces is None:  # (another router's reach the board within a posting period)
            raise APIError(404, "no trace of that request id", param="request_id")
        return JSONResponse({"request_id": request_id, "traces": traces})

    @api.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text for every replica of both pools and the routers (cluster/router/metrics.py)."""
        self._ensure_posting()
        others = [r for r in await ask_board(self.app_name, "read") if r.get("replica") != self.replica_id]
        body = render_metrics(others + [await self._stats()], self.openai.model_name)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- gRPC (Serve's gRPC proxy calls the method of the RPC's name) ---------------------
    async def Generate(self, request: Any, grpc_context: RayServegRPCContext) -> AsyncIterator[Any]:
        """tandem.v1.Tandem/Generate: the same admission, validation, sampling and trace as the
        HTTP routes; an error ends the stream with its gRPC status code (grpc_api.STATUS_CODES).
        The trace's id is Serve's `request_id` (the client's metadata of that name, or Serve's own),
        which Serve returns in the trailing metadata."""
        self._ensure_posting()
        admitted = False
        try:
            self._check_key(dict(grpc_context.invocation_metadata()).get("authorization", ""))
            await self._admit()
            admitted = True
            rid = grpc_context.request_id() or serving_request_id() or uuid.uuid4().hex
            if not REQUEST_ID.match(rid):
                raise APIError(400, "request_id must be 1-128 of A-Z a-z 0-9 . _ : -", param="request_id")
            request_log.current_request_id.set(rid)
            async for message in grpc_api.generate(self.openai, request, self.config.request_timeout_s,
                                                   self.config.max_request_bytes):
                yield message
        except Exception as exc:  # (a client gone cancels the generator: nothing to answer)
            err = exc if isinstance(exc, APIError) else as_api_error(exc)
            grpc_context.set_code(grpc_api.status_code(err))
            grpc_context.set_details(err.message)
            raise err from None
        finally:
            if admitted:
                self._release()

    # -- helpers -----------------------------------------------------------------------
    async def _serve(self, request: Request, handler) -> Response:
        """Admit, answer, and tag the answer with the request's id (X-Request-Id, the key of its
        trace): the client's own when well-formed, else the one Serve's proxy gave it."""
        self._ensure_posting()
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        if not REQUEST_ID.match(rid):
            response = error_response(APIError(400, "X-Request-Id must be 1-128 of A-Z a-z 0-9 . _ : -",
                                               param="X-Request-Id"))
        else:
            request_log.current_request_id.set(rid)
            response = await self._answer(request, handler)
            response.headers["X-Request-Id"] = rid
        return response

    async def _answer(self, request: Request, handler) -> Response:
        try:
            await self._admit()
        except APIError as exc:
            return error_response(exc)
        streaming = False
        try:
            self._auth(request)
            body = await read_json(request, self.config.max_request_bytes)
            result = await handler(body, request_timeout(request, self.config.request_timeout_s))
            if isinstance(result, dict):
                return JSONResponse(result)
            streaming = True
            return ClosingStream(result, self._release)
        except APIError as exc:
            return error_response(exc)
        except Exception as exc:
            return error_response(as_api_error(exc))
        finally:
            if not streaming:
                self._release()

    async def _local(self, request: Request, handler) -> Response:
        """A request the router answers itself: the key, the body limit, OpenAI-shaped errors."""
        try:
            self._auth(request)
            return JSONResponse(handler(self.openai, await read_json(request, self.config.max_request_bytes)))
        except APIError as exc:
            return error_response(exc)
        except Exception as exc:
            return error_response(APIError(500, f"internal error: {type(exc).__name__}", type_="internal_error"))

    async def _admit(self) -> None:
        """Take a slot for one request (`_release` gives it back), or refuse it with a 503. The
        slot is taken before the look at the pools awaits (a router's first requests wait on it):
        a burst that arrives meanwhile finds it taken, not `max_concurrent_requests` all free."""
        limit = self.config.max_concurrent_requests
        if limit is not None and self.active >= limit:
            self._reject(APIError(503, "the server is at capacity; retry later", type_="server_error",
                                  code="overloaded", headers={"Retry-After": "1"}))
        self.active += 1
        try:
            empty = await self._empty_pool()
            if empty is not None:  # a call into it would wait for a replica that may never come
                self._reject(APIError(503, f"no {empty} replica is running; retry later", type_="server_error",
                                      code="pool_unavailable", headers={"Retry-After": "1"}))
        except BaseException:
            self.active -= 1
            raise

    def _release(self) -> None:
        self.active -= 1

    def _reject(self, err: APIError) -> None:
        self.log.counters[f"rejected_{err.code}"] += 1
        raise err

    async def _stats(self, new_traces: bool = False) -> dict[str, Any]:
        stats = {"pool": "router", "replica": self.replica_id, "active": self.active, "cpus": self.cpus.describe(),
                 **self.log.stats()}
        return {**stats, "traces": self.log.drain()} if new_traces else stats

    def _ensure_posting(self) -> None:
        if self._poster is None or self._poster.done():
            self._poster = asyncio.get_running_loop().create_task(
                post_forever(self.app_name, self.replica_id, lambda: self._stats(new_traces=True)))

    async def _empty_pool(self) -> str | None:
        """A pool with no replica taking calls (as of the last look, at most POOL_WATCH_PERIOD_S old
        while requests come). A router idle for POOL_WATCH_IDLE_S stops looking; the next request
        starts again, looking at once if it kept no view, or one with an empty pool."""
        self._asked = time.monotonic()
        if self._watcher is None or self._watcher.done():
            if self.running is None or self._first_empty() is not None:
                await self._look_at_pools()
            self._watcher = asyncio.get_running_loop().create_task(self._watch_pools())
        return self._first_empty()

    def _first_empty(self) -> str | None:
        if self.running is None:  # the controller did not answer: let the request through
            return None
        return next((p for p in self.pools if self.running.get(p, 0) == 0), None)

    async def _watch_pools(self) -> None:
        while time.monotonic() - self._asked < self.pool_watch_idle_s:
            await asyncio.sleep(self.pool_watch_period_s)
            await self._look_at_pools()

    async def _look_at_pools(self) -> None:
        try:
            running = await asyncio.to_thread(running_replicas, self.app_name)
            if running is not None:
                self.running = running
        except Exception:  # the controller restarting: keep the last view
            pass

    def _auth(self, request: Request) -> None:
        self._check_key(request.headers.get("authorization", ""))

    def _check_key(self, authorization: str) -> None:
        """`authorization`: the HTTP header, or the gRPC metadata of that name."""
        if self.api_key is None:
            return
        if not hmac.compare_digest(authorization.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "invalid or missing API key", type_="authentication_error",
                           code="invalid_api_key")


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve's app builder: validates `args` (unknown keys are errors) and wires the pools.
    The pools' deployments are imported here, not at the top: a router replica loads this
    module and never needs the engine (nor torch)."""
    from cluster.decode.deployment import DecodeDeployment
    from cluster.prefill.deployment import PrefillDeployment

    return compose_app(args, PrefillDeployment, DecodeDeployment)


def compose_app(args: dict[str, Any] | None, prefill_pool: Deployment, decode_pool: Deployment) -> serve.Application:
    """The app over these pool deployments (`build_app`'s; tests pass subclasses of them)."""
    config = AppConfig.from_args(args)
    raw = dict(args or {})
    stats_period = {"request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
                    "request_router_kwargs": {"prefix_aware": config.prefix_aware_routing}}
    decode_router = RequestRouterConfig(request_router_class="cluster.router.request_routers:DecodeRouter",
                                        **stats_period)
    if config.mode == "colocated":
        decode = decode_pool.options(request_router_config=decode_router).bind(raw, None)
    else:
        prefill_router = RequestRouterConfig(request_router_class="cluster.router.request_routers:PrefillRouter",
                                             **stats_period)
        prefill = prefill_pool.options(request_router_config=prefill_router).bind(raw)
        decode = decode_pool.options(request_router_config=decode_router).bind(raw, prefill)
    return RouterDeployment.bind(raw, decode)
