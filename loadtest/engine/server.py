"""One simulated engine on the network: vLLM's HTTP API over an EngineCore, in real time.

The engine itself (profile, tokenizer, request parsing, core, fault state) is an
EngineReplica (replica.py), the one the virtual-clock fleet (virtual.py) drives too; this
module adds only the socket, the wall clock and the SSE writing.

`SimEngine` owns a listening socket, an aiohttp application and one asyncio task that
drives the core: it sleeps until the core's next step ends (a duration the timing model
computed, divided by `time_scale`), runs the step, writes each streamed request's new
tokens (one SSE event per token, straight from the step) or wakes the handler of a
non-streamed one that finished, and publishes the step's KV events as one batch.

Routes (vLLM's, vllm/entrypoints/openai/api_server.py): POST /v1/completions,
POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics, GET /version,
POST /tokenize, POST /detokenize. Simulator-only: POST /admin/fault (a fault or a list,
see faults.py), DELETE /admin/fault (clear all), GET /admin/state.

Prefill/decode disaggregation (kv_transfer.py): the engine joins a KV transfer fabric
(the process-wide one unless given another) while it runs, under its engine id (and, with
SGLang's protocol, its bootstrap address). SGLang's legs: a decode leg waits here for its
room's KV before it is submitted; a prefill leg's answer waits for its KV to be fetched.
GET /server_info (and /get_server_info, its older name) answers SGLang's disaggregation_mode
and bootstrap port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from loadtest.engine import api
from loadtest.engine.config import EngineSpec
from loadtest.engine.core import RequestRejected, SimRequest, StepResult
from loadtest.engine.faults import FaultError, FaultSpec, FaultState, parse_fault
from loadtest.engine.kv_events import ZmqEventPublisher
from loadtest.engine.kv_transfer import DEFAULT_FABRIC, KVTransferFabric
from loadtest.engine.replica import EngineReplica
from loadtest.engine.tokenizer import Tokenizer

log = logging.getLogger("meshd.sim_engine")

VERSION = "0.32.0+meshd.sim"
# Request bodies up to this size (long-context prompts are large JSON).
MAX_BODY_BYTES = 64 * 1024 * 1024
# Unread bytes a streamed response may queue before its client counts as stuck.
MAX_STREAM_BUFFER_BYTES = 16 * 1024 * 1024
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# A wake-up this close to the step's end runs the step now (timer granularity).
_EARLY_S = 0.0005

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Reset(Exception):
    """Raised inside a handler whose connection was reset on purpose."""


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


class SimEngine:
    """A simulated vLLM engine serving on host:port (port 0 picks a free one)."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        index: int = 0,
        host: str = "127.0.0.1",
        tokenizer: Tokenizer | None = None,
        fabric: KVTransferFabric | None = None,
    ) -> None:
        # Tolerate 20 ms of wall-clock lateness before the GPU loses time.
        self.replica = EngineReplica(
            spec, index=index, tokenizer=tokenizer, max_lag_s=0.02 * spec.time_scale
        )
        self.spec = spec
        self.index = index
        self.host = host
        self.name = self.replica.name
        self.time_scale = spec.time_scale
        self.profile = self.replica.profile
        self.tokenizer = self.replica.tokenizer
        self.generator = self.replica.generator
        self.core = self.replica.core
        self.faults = self.replica.faults
        self.ctx = self.replica.ctx
        self.port = spec.port
        self.fabric = fabric if fabric is not None else DEFAULT_FABRIC
        self.publisher: ZmqEventPublisher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._placeholder: socket.socket | None = None
        self._driver: asyncio.Task[None] | None = None
        self._sleeper: asyncio.Future[None] | None = None
        self._sleep_until: float | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self._active: dict[SimRequest, web.Request] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Set while the engine accepts requests; see wait_ready().
        self.ready = asyncio.Event()
        self._closing = False
        self.created = int(time.time())

    # ---- clock -------------------------------------------------------------------
    def sim_now(self) -> float:
        """Simulated seconds since start."""
        assert self._loop is not None
        return (self._loop.time() - self._t0) * self.time_scale

    @property
    def bootstrap_port(self) -> int:
        """SGLang's --disaggregation-bootstrap-port: the spec's, else the HTTP port."""
        return self.spec.bootstrap_port or self.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ---- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._t0 = loop.time()
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._middleware])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_get("/server_info", self._server_info)  # its newer name
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/admin/fault", self._admin_fault)
        app.router.add_delete("/admin/fault", self._admin_clear)
        app.router.add_get("/admin/state", self._admin_state)
        # handler_cancellation: a client that goes away aborts its request, as in vLLM.
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, handler_cancellation=True
        )
        await self._runner.setup()
        self._placeholder = _bind(self.host, self.port)
        self.port = self._placeholder.getsockname()[1]
        self.replica.connect(
            self.fabric,
            clock=self.sim_now,
            wake=self._kick,
            bootstrap=(self.host, self.bootstrap_port),
        )
        spec = self.spec
        if spec.kv_events_endpoint:
            self.publisher = ZmqEventPublisher(
                spec.kv_events_endpoint,
                replay_endpoint=spec.kv_events_replay_endpoint,
                topic=spec.kv_events_topic,
                event_format="array" if spec.kv_events_format == "array" else "map",
            )
        if spec.cold_start_s > 0:
            self._begin_loading(spec.cold_start_s, spec.cold_start_mode)
        if not self.faults.refusing(self.sim_now()):
            await self._listen()
        self._driver = loop.create_task(self._drive(), name=f"sim-engine-{self.name}")
        for fault in spec.faults:
            self.schedule(fault)

    async def stop(self) -> None:
        self._closing = True
        self.replica.disconnect()
        for h in self._timers:
            h.cancel()
        self._timers.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        for req, request in list(self._active.items()):
            self.core.abort(req, self.sim_now())
            self._wake(req)
            if request.transport is not None:
                request.transport.abort()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._placeholder is not None:
            self._placeholder.close()
            self._placeholder = None
        if self._runner is not None:
            await self._runner.cleanup()
        if self.publisher is not None:
            await self.publisher.close()

    async def _listen(self) -> None:
        if self._closing or self._runner is None:
            return
        if self._server is not None:
            if not self.faults.loading(self.sim_now()):
                self.ready.set()
            return
        assert self._loop is not None
        protocol_factory = self._runner.server
        assert protocol_factory is not None
        sock = self._placeholder or _bind(self.host, self.port)
        self._placeholder = None
        self._server = await self._loop.create_server(protocol_factory, sock=sock, backlog=1024)
        if not self.faults.loading(self.sim_now()):
            self.ready.set()

    def _refuse(self) -> None:
        """Stop accepting connections but keep the port (a bound, non-listening socket)."""
        self.ready.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._placeholder is None:
            self._placeholder = _bind(self.host, self.port)

    # ---- the driver ----------------------------------------------------------------
    async def _drive(self) -> None:
        core = self.core
        scale = self.time_scale
        while not self._closing:
            t = core.next_event_time()
            now = self.sim_now()
            if t is None:
                await self._sleep(None)
                continue
            delay = (t - now) / scale
            if delay > _EARLY_S:
                await self._sleep(delay, t)
                continue
            try:
                result = core.step(max(now, t))
            except Exception:  # pragma: no cover - a bug; keep serving other requests
                log.exception("engine %s: step failed", self.name)
                await asyncio.sleep(0.01)
                continue
            self._dispatch(result)

    async def _sleep(self, delay: float | None, until: float | None = None) -> None:
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        self._sleeper = fut
        self._sleep_until = until
        handle = self._loop.call_later(delay, _resolve, fut) if delay is not None else None
        try:
            await fut
        finally:
            if handle is not None:
                handle.cancel()
            self._sleeper = None

    def _kick(self) -> None:
        """Wake the driver if the core's next event is earlier than its sleep."""
        fut = self._sleeper
        if fut is None or fut.done():
            return
        t = self.core.next_event_time()
        if t is not None and (self._sleep_until is None or t < self._sleep_until):
            fut.set_result(None)

    def _dispatch(self, result: StepResult) -> None:
        for req in result.updated:
            w = req.waiter
            if w is not None:
                w.notify(req)
        if result.kv_events and self.publisher is not None:
            self.publisher.publish(result.kv_events)

    @staticmethod
    def _wake(req: SimRequest) -> None:
        w = req.waiter
        if w is not None:
            w.notify(req)

    # ---- faults ------------------------------------------------------------------
    def schedule(self, fault: FaultSpec, *, origin: asyncio.BaseTransport | None = None) -> None:
        """Apply a fault now, or at its `at` (simulated seconds since start)."""
        if fault.at is None:
            self.inject(fault, origin=origin)
            return
        assert self._loop is not None
        delay = max(0.0, (fault.at - self.sim_now()) / self.time_scale)
        self._timers.append(self._loop.call_later(delay, self.inject, fault))

    def inject(self, fault: FaultSpec, *, origin: asyncio.BaseTransport | None = None) -> None:
        """Apply a fault now. `origin`: a connection a restart must not close (the admin's)."""
        now = self.sim_now()
        action = self.replica.apply_fault(fault, now)
        if action == "restart":
            self._restart(now, fault.seconds or 0.0, fault.mode, origin)
        elif action == "cold_start":
            self._begin_loading(fault.seconds or 0.0, fault.mode)
        elif action == "clear" and self._loop is not None:
            self._background(self._listen())
        self._kick()

    def _restart(
        self, now: float, cold_start_s: float, mode: str, origin: asyncio.BaseTransport | None
    ) -> None:
        dropped = self.core.restart(now)
        events = self.core.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)
        for req in dropped:
            request = self._active.get(req)
            if request is not None and request.transport is not None:
                request.transport.abort()
            self._wake(req)
        if self._runner is not None and self._runner.server is not None:
            for conn in self._runner.server.connections:
                if conn.transport is not origin:
                    conn.force_close()
        if cold_start_s > 0:
            self._begin_loading(cold_start_s, mode)

    def _begin_loading(self, seconds: float, mode: str) -> None:
        assert self._loop is not None
        now = self.sim_now()
        self.faults.start_loading(
            now, seconds, "unavailable" if mode == "unavailable" else "refuse"
        )
        self.ready.clear()
        if mode == "refuse":
            self._refuse()
        self._timers.append(self._loop.call_later(seconds / self.time_scale, self._end_loading))

    def _end_loading(self) -> None:
        assert self._loop is not None
        left = self.faults.loading_until - self.sim_now()
        if left > 0 and self.faults.loading(self.sim_now()):
            # Extended by a later fault, or the timer fired a hair early.
            self._timers.append(
                self._loop.call_later(max(left / self.time_scale, 1e-4), self._end_loading)
            )
            return
        self._background(self._listen())

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_ready(self) -> None:
        """Return once the engine accepts requests (listening, weights loaded)."""
        await self.ready.wait()

    # ---- HTTP --------------------------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if not path.startswith("/admin/"):
            rej = self.replica.refusal(self.sim_now(), generation=path in _GENERATION_PATHS)
            if rej is not None:
                resp = self._error(rej.status, rej.message)
                if rej.retry_after is not None:
                    resp.headers["Retry-After"] = str(max(1, round(rej.retry_after)))
                return resp
        try:
            return await handler(request)
        except _Reset:
            # The transport is gone; aiohttp only needs some response object.
            return web.Response(status=500)

    @staticmethod
    def _error(
        status: int, message: str, param: str | None = None, err_type: str | None = None
    ) -> web.Response:
        return web.Response(
            text=api.dumps(api.error_body(status, message, param, err_type)),
            status=status,
            content_type="application/json",
        )

    @staticmethod
    async def _json(request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise api.ApiError(400, f"the request body is not valid JSON: {exc}") from None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: api.RequestKind) -> web.StreamResponse:
        try:
            body = await self._json(request)
            parsed = self.replica.parse(kind, body)
        except api.ApiError as exc:
            return self._error(exc.status, exc.message, exc.param)
        rid = api.request_id(kind, request.headers.get("X-Request-Id"))
        try:
            wait = self.replica.room_to_await(parsed)
            if wait is not None:
                await self._await_room(parsed, *wait)
            req = self.replica.submit(parsed, rid, self.sim_now())
        except api.ApiError as exc:
            if exc.in_stream and parsed.stream:
                return await self._stream_error(request, exc)
            return self._error(exc.status, exc.message, exc.param, exc.err_type)
        except RequestRejected as exc:
            return self._error(400, str(exc))
        self._kick()
        self._active[req] = request
        try:
            if req.kv_hold and parsed.bootstrap is not None and self.replica.sglang_leg:
                return await self._prefill_leg(request, req, parsed, rid)
            if parsed.stream:
                return await self._stream(request, req, parsed, rid)
            return await self._unary(request, req, parsed, rid)
        except ConnectionResetError:
            # The client went away mid-stream; vLLM aborts the request the same way.
            self.core.abort(req, self.sim_now())
            return web.Response(status=499)
        finally:
            self._active.pop(req, None)
            if not req.finished:
                self.core.abort(req, self.sim_now())

    def _reset(self, request: web.Request, req: SimRequest) -> None:
        self.core.abort(req, self.sim_now())
        if request.transport is not None:
            request.transport.abort()
        raise _Reset

    def usage(self, req: SimRequest) -> dict[str, Any]:
        return self.replica.usage(req)

    def _answer_doc(
        self, parsed: api.ParsedRequest, rid: str, req: SimRequest, usage: dict[str, Any]
    ) -> dict[str, Any]:
        """A finished request's whole (not streamed) answer, in the shape its API gives."""
        build = api.chat_response if parsed.kind == "chat" else api.completion_response
        return build(
            rid,
            self.created,
            parsed.model,
            req.output_text(),
            req.finish_reason,
            req.stop_reason,
            usage,
        )

    async def _whole(self, request: web.Request, req: SimRequest) -> None:
        """Wait until `req` is done (its whole answer, not streamed); a reset or crash
        fault resets the connection."""
        assert self._loop is not None
        waiter = _UnaryWaiter(self.faults, self._loop.create_future())
        req.waiter = waiter
        waiter.notify(req)
        await waiter.done
        if req.reset:
            self._reset(request, req)
        if waiter.crash:
            self.faults.take_crash()
            self._reset(request, req)

    async def _unary(
        self, request: web.Request, req: SimRequest, parsed: api.ParsedRequest, rid: str
    ) -> web.StreamResponse:
        await self._whole(request, req)
        doc = self._answer_doc(parsed, rid, req, self.usage(req))
        if parsed.kv_transfer is not None:
            # vLLM's responses carry the field (null but for a prefill step's answer).
            doc[api.KV_PARAMS] = self.replica.transfer_params(req, self.host, self.port)
        resp = web.Response(text=api.dumps(doc), content_type="application/json")
        fmt = request.headers.get("endpoint-load-metrics-format")
        if fmt:
            header = api.orca_header(fmt, self.core.num_waiting, self.core.kv_usage())
            if header is not None:
                resp.headers["endpoint-load-metrics"] = header
        return resp

    # ---- SGLang's legs (kv_transfer.py) ----------------------------------------------
    async def _await_room(self, parsed: api.ParsedRequest, engine_id: str, key: str) -> None:
        """Wait until the room's KV is pinned on `engine_id`, or raise the 410 of a decode
        leg whose KV never came (bootstrap_timeout_s)."""
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()

        def heard(event: str) -> None:
            if event == "held" and not fut.done():
                fut.set_result(None)

        stop = self.fabric.watch(engine_id, key, heard)
        try:
            async with asyncio.timeout(self.spec.bootstrap_timeout_s / self.time_scale):
                await fut
        except TimeoutError:
            raise self.replica.room_timeout(parsed, engine_id) from None
        finally:
            stop()

    async def _prefill_leg(
        self, request: web.Request, req: SimRequest, parsed: api.ParsedRequest, rid: str
    ) -> web.StreamResponse:
        """An SGLang prefill leg: prefilled, its KV pinned; answered once a decode leg
        fetched it (500 when none did within kv_hold_s), streamed or not, as one body."""
        await self._whole(request, req)
        why = await self._hold_end(req)
        if why is not None:
            assert parsed.bootstrap is not None
            return self._error(
                500,
                f"Prefill transfer failed for bootstrap_room {parsed.bootstrap.room}: {why}",
                "bootstrap_room",
            )
        usage = self.usage(req)
        if not parsed.stream:
            doc = self._answer_doc(parsed, rid, req, usage)
            return web.Response(text=api.dumps(doc), content_type="application/json")
        fmt = api.StreamFormatter(parsed.kind, rid, self.created, parsed.model)
        parts = [fmt.role()] if parsed.kind == "chat" else []
        parts.append(fmt.token(req.output_text(), req.finish_reason, req.stop_reason))
        if parsed.include_usage:
            parts.append(fmt.usage(usage))
        return web.Response(body="".join(parts).encode() + api.DONE, headers=SSE_HEADERS)

    async def _hold_end(self, req: SimRequest) -> str | None:
        """Wait for a prefill leg's pinned KV to be fetched: None; or why it was not
        (expired, released, dropped, nothing pinned). A leg whose router went away drops
        its KV unless a decode leg is fetching it."""
        assert self._loop is not None
        if req.held_block_ids is None:
            return "nothing was pinned"
        key = req.request_id
        engine_id = self.replica.kv_engine_id
        fate = self.fabric.fate(engine_id, key)
        if fate is None:
            fut: asyncio.Future[str] = self._loop.create_future()

            def heard(event: str) -> None:
                if event != "held" and not fut.done():
                    fut.set_result(event)

            stop = self.fabric.watch(engine_id, key, heard)
            try:
                fate = await fut
            except asyncio.CancelledError:
                held = self.core.held(key)
                if held is not None and not held.claimed:
                    self.core.release_hold(held, self.sim_now(), fetched=False)
                raise
            finally:
                stop()
        if fate in ("fetched", "already_fetched"):
            return None
        return {
            "expired": f"no decode engine fetched the KV within kv_hold_s "
            f"({self.spec.kv_hold_s:g} s)",
            "released": "the decode leg ended before its KV transfer",
            "dropped": "the engine restarted",
        }.get(fate, fate)

    async def _server_info(self, request: web.Request) -> web.StreamResponse:
        """SGLang's /server_info (/get_server_info), the parts a router reads: the
        disaggregation mode and the prefill engine's bootstrap port."""
        spec = self.spec
        mode = "null" if self.replica.role == "both" else self.replica.role
        return web.json_response(
            {
                "model_path": spec.model,
                "served_model_name": spec.model,
                "disaggregation_mode": mode if spec.pd_protocol == "sglang" else "null",
                "disaggregation_bootstrap_port": self.bootstrap_port,
                "disaggregation_transfer_backend": "simulated",
                "version": VERSION,
            }
        )

    async def _stream(
        self, request: web.Request, req: SimRequest, parsed: api.ParsedRequest, rid: str
    ) -> web.StreamResponse:
        assert self._loop is not None
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        transport = request.transport
        if transport is None:
            return resp
        sink = _StreamSink(
            self,
            transport,
            # aiohttp chunks an HTTP/1.1 stream without saying so in resp.chunked.
            resp.headers.get("Transfer-Encoding", "").lower() == "chunked",
            parsed,
            api.StreamFormatter(parsed.kind, rid, self.created, parsed.model),
            self._loop.create_future(),
        )
        req.waiter = sink
        sink.notify(req)
        outcome = await sink.done
        if outcome == "reset":
            raise _Reset
        if outcome == "done":
            await resp.write_eof()
        return resp

    async def _stream_error(self, request: web.Request, exc: api.ApiError) -> web.StreamResponse:
        """An error a streamed request meets after vLLM sent its head: HTTP 200, the
        error as one event, then [DONE] (serving_completion's except branch)."""
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        doc = api.error_body(exc.status, exc.message, exc.param, exc.err_type)
        await resp.write(f"data: {api.dumps(doc)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.StreamResponse:
        doc = api.models_response(self.spec.model, self.spec.max_model_len, self.created)
        return web.Response(text=api.dumps(doc), content_type="application/json")

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"version": VERSION})

    def metrics_text(self) -> str:
        return self.replica.metrics_text(self.sim_now(), self.time_scale)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=self.metrics_text().encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        try:
            ids = api.parse_tokenize(await self._json(request), self.ctx)
        except api.ApiError as exc:
            return self._error(exc.status, exc.message, exc.param)
        return web.json_response(
            {
                "count": len(ids),
                "max_model_len": self.spec.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
        )

    async def _detokenize(self, request: web.Request) -> web.StreamResponse:
        try:
            ids = api.parse_detokenize(await self._json(request))
        except api.ApiError as exc:
            return self._error(exc.status, exc.message, exc.param)
        return web.json_response({"prompt": self.tokenizer.decode(ids)})

    async def _admin_fault(self, request: web.Request) -> web.StreamResponse:
        try:
            doc = await self._json(request)
            specs = [parse_fault(d) for d in (doc if isinstance(doc, list) else [doc])]
        except (api.ApiError, FaultError) as exc:
            return self._error(400, str(exc))
        for spec in specs:
            self.schedule(spec, origin=request.transport)
        return web.json_response({"applied": [s.to_json() for s in specs]})

    async def _admin_clear(self, request: web.Request) -> web.StreamResponse:
        self.inject(FaultSpec("clear"))
        return web.json_response({"applied": [{"kind": "clear"}]})

    async def _admin_state(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.state())

    def state(self) -> dict[str, Any]:
        core = self.core
        now = self.sim_now()
        pub = self.publisher
        return {
            "name": self.name,
            "index": self.index,
            "url": self.url,
            "gpu": self.profile.gpu,
            "model": self.spec.model,
            "price_per_gpu_hour": self.profile.price_per_gpu_hour,
            "time_scale": self.time_scale,
            "sim_time": now,
            "running": core.num_running,
            "waiting": core.num_waiting,
            "kv_cache_usage": core.kv_usage(),
            "kv_blocks": core.pool.num_blocks,
            "cached_blocks": core.pool.num_cached,
            "block_size": core.block_size,
            "max_num_seqs": core.max_num_seqs,
            "max_num_batched_tokens": core.max_num_batched_tokens,
            "steps": core.steps,
            "busy_time": core.busy_time_at(now),
            "slowdown": core.slowdown,
            "paused": core.paused,
            "loading": self.faults.loading(now),
            "listening": self._server is not None,
            "faults": self.faults.describe(),
            "role": self.replica.role,
            "kv_role": self.replica.kv_role,
            "kv_engine_id": self.replica.kv_engine_id,
            "kv_held_requests": core.num_held_requests,
            "kv_held_blocks": core.num_held_blocks,
            "kv_transferring": core.num_transferring,
            "kv_events": None
            if pub is None
            else {
                "endpoint": pub.bound_endpoint(),
                "replay_endpoint": pub.bound_replay_endpoint(),
                "topic": pub.topic,
                "next_seq": pub.next_seq,
            },
        }


class _UnaryWaiter:
    """Wakes a non-streamed request's handler once: at the end, a reset or a planned crash."""

    __slots__ = ("crash", "done", "faults")

    def __init__(self, faults: FaultState, done: asyncio.Future[None]) -> None:
        self.faults = faults
        self.done = done
        self.crash = False

    def notify(self, req: SimRequest) -> None:
        if self.done.done():
            return
        limit = self.faults.peek_crash()
        if limit is not None and req.num_output_tokens >= limit:
            self.crash = True
            self.done.set_result(None)
        elif req.finished or req.reset:
            self.done.set_result(None)


class _StreamSink:
    """Writes a streamed request's SSE events straight from the driver, one per token.

    Writing from the step that produced the tokens, rather than waking the handler task
    for each one, is what keeps a fleet's per-token cost low (selfbench.py measures it).
    The HTTP/1.1 chunk framing is the one aiohttp's StreamWriter uses; the handler only
    sends the closing chunk (write_eof) once `done` resolves with "done".
    """

    __slots__ = ("chunked", "done", "engine", "fmt", "parsed", "sent", "transport")

    def __init__(
        self,
        engine: SimEngine,
        transport: asyncio.Transport,
        chunked: bool,
        parsed: api.ParsedRequest,
        fmt: api.StreamFormatter,
        done: asyncio.Future[str],
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.chunked = chunked
        self.parsed = parsed
        self.fmt = fmt
        self.done = done
        self.sent = -1 if parsed.kind == "chat" else 0

    def _close(self, outcome: str) -> None:
        if not self.done.done():
            self.done.set_result(outcome)

    def notify(self, req: SimRequest) -> None:
        if self.done.done():
            return
        transport = self.transport
        if req.reset:
            transport.abort()
            self._close("reset")
            return
        if transport.is_closing():
            # The client went away; vLLM aborts the request the same way.
            self.engine.core.abort(req, self.engine.sim_now())
            self._close("gone")
            return
        fmt = self.fmt
        parts: list[str] = []
        sent = self.sent
        if sent < 0:
            parts.append(fmt.role())
            sent = 0
        pieces = req.output_pieces
        n_out = len(pieces)
        finished = req.finished
        faults = self.engine.faults
        limit = faults.peek_crash()
        stop_at = n_out if limit is None else min(n_out, max(limit, sent))
        if stop_at > sent:
            last = n_out - 1
            token = fmt.token
            if self.parsed.continuous_usage:
                # stream_options.continuous_usage_stats: usage so far on every chunk.
                p, c = req.num_prompt_tokens, req.cached_tokens
                for i in range(sent, stop_at):
                    end_here = finished and i == last
                    parts.append(
                        token(
                            pieces[i],
                            req.finish_reason if end_here else None,
                            req.stop_reason if end_here else None,
                            api.usage(p, i + 1, c),
                        )
                    )
            else:
                for i in range(sent, stop_at):
                    if finished and i == last:
                        parts.append(token(pieces[i], req.finish_reason, req.stop_reason))
                    else:
                        parts.append(token(pieces[i]))
        self.sent = stop_at
        # stop_at >= limit exactly when n_out >= limit: the rule is FaultState's.
        crash = faults.stream_crash_due(n_out, finished) is not None
        end = not crash and finished and stop_at == n_out
        if end:
            if n_out == 0:
                parts.append(fmt.token("", req.finish_reason, req.stop_reason))
            if self.parsed.include_usage:
                parts.append(fmt.usage(self.engine.usage(req)))
        if parts or end:
            data = "".join(parts).encode()
            if end:
                data += api.DONE
            if self.chunked:
                data = b"%x\r\n%b\r\n" % (len(data), data)
            transport.write(data)
            if transport.get_write_buffer_size() > MAX_STREAM_BUFFER_BYTES:
                # A client that stopped reading: drop it rather than buffer without end.
                self.engine.core.abort(req, self.engine.sim_now())
                transport.abort()
                self._close("gone")
                return
        if crash:
            faults.take_crash()
            self.engine.core.abort(req, self.engine.sim_now())
            transport.abort()
            self._close("reset")
        elif end:
            self._close("done")


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
