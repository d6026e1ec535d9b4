"""`meshd sidecar`: the outbound data plane. Relays OpenAI-compatible requests to a pool's
engines, SSE chunk by chunk, and answers every failure with a well-formed OpenAI-style
error instead of a hang.

A request meets the layers in this order (docs/architecture.md): the listener
(meshd/listener.py: HTTP/1.1 framing and the connection's limits) -> the request layer
(meshd/intake.py: body, parse, trust, pool, prompt hashes) -> admission
(meshd/admission_gate.py) -> routing and attempts (meshd/attempts.py: order, screen, retry
within the budget) -> the relay (meshd/relay.py: whole or streamed, mid-stream failover) ->
accounting (meshd/accounting.py: metrics, the trace that feeds the access log, spans and the
cost ledger). Decisions (parse, hash, choose an endpoint, admit) are `filters/` objects; this
module builds the layers, starts and stops the listeners, and runs the reaper.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from filters.chars_per_token import CharsPerToken
from filters.hotpath import IMPLEMENTATION
from filters.request import PATH_KINDS
from filters.vllm_metrics import EngineMetrics
from meshd import __version__
from meshd.accounting import Accounting
from meshd.admin import PROBES_APP, build_admin_app
from meshd.admission_gate import AdmissionGate
from meshd.attempts import Attempts
from meshd.autoscale_metrics import PoolSignals
from meshd.config import Config, ConfigError, load_config
from meshd.context import Plane
from meshd.heap import GcCollector, gc_pauses, settle
from meshd.http_message import HttpRequest, ListenerLimits, Reply
from meshd.intake import Intake
from meshd.listener import HttpServer
from meshd.metrics import DataPlaneMetrics
from meshd.observe import RequestObserver
from meshd.pools import build_routers, guard_config, guards, precise_prefixes, retry_budgets
from meshd.relay import Relay
from meshd.upstream import UpstreamPool

if TYPE_CHECKING:
    from meshd.control_feed import ControlFeed

__all__ = ["Sidecar", "build_routers", "guard_config", "serve"]

log = logging.getLogger("meshd.sidecar")

# The reaper's period bounds how late an idle or overall timeout fires; a
# single periodic sweep is cheaper than arming a timer per relayed chunk.
_REAPER_PERIOD_S = 0.25


class Sidecar:
    """One sidecar: its listeners, its layers and the state they share."""

    def __init__(self, config: Config, *, original_destination_fn: Any = None) -> None:
        self.config = config
        # Tests without iptables inject where a transparent connection was headed.
        self._original_destination_fn = original_destination_fn
        self.metrics = DataPlaneMetrics()
        # meshd_gc_*: the process's collector pauses (meshd/heap.py).
        self.metrics.registry.register(GcCollector(gc_pauses()))
        self.routers = build_routers(config)
        # Pool -> its precise prefix path (routing.tokenizers; policy meshd only).
        self.precise = precise_prefixes(config, self.routers)
        # Model -> learnt characters per prompt token (routing.learn_chars_per_token).
        self.chars_per_token: CharsPerToken | None = (
            CharsPerToken() if config.routing.learn_chars_per_token else None
        )
        self.plane = Plane(
            config,
            self.metrics,
            self.routers,
            guards(config, self.routers),
            retry_budgets(config),
            RequestObserver.from_config(config, self.metrics),
        )
        self.guards = self.plane.guards
        self.retry_budgets = self.plane.retry_budgets
        self.observer = self.plane.observer
        # Each pool's demand and desired replicas (meshd_pool_*, docs/autoscaling.md).
        assert self.observer.demand is not None
        self.autoscale = PoolSignals(config, self.routers, self.guards, self.observer.demand)
        self.metrics.autoscale.bind(self.autoscale)
        acct = self.accounting = Accounting(self.metrics)
        if config.response_cache.enabled:
            from meshd.response_cache import ResponseCache

            self.plane.cache = ResponseCache(config, acct, self.metrics.registry)
        self.gate = AdmissionGate(self.plane, acct)
        attempts = Attempts(self.plane, acct, self.gate, self.chars_per_token)
        self.relay = Relay(self.plane, acct, attempts)
        self.intake = Intake(
            self.plane,
            acct,
            self.gate,
            attempts,
            precise=self.precise,
            chars_per_token=self.chars_per_token,
            intercepted_pool=self._intercepted_pool,
        )
        limits = config.limits
        self.server = HttpServer(
            self._dispatch,
            ListenerLimits(
                max_header_count=limits.max_header_count,
                max_header_bytes=limits.max_header_bytes,
                max_body_bytes=limits.max_body_bytes,
                client_header_timeout_s=limits.client_header_timeout_s,
                client_body_timeout_s=limits.client_body_timeout_s,
                keepalive_timeout_s=limits.keepalive_timeout_s,
            ),
            on_reject=lambda code: self.metrics.rejected.labels(code).inc(),
        )
        self.draining = False
        self._listener: asyncio.Server | None = None
        self._admin_runner: web.AppRunner | None = None
        self._probe_runner: web.AppRunner | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._transparent: Any = None
        self._feed: Any = None  # meshd.control_feed.ControlFeed when control_plane is set
        # meshd.demand_publisher.DemandPublisher: each pool's demand to the control planes.
        self.demand_publisher: Any = None
        # meshd.engine_probe.EngineProbes: each endpoint's /metrics, without a control plane.
        self.probes: Any = None
        self.addresses: dict[str, str] = {}

    @property
    def active(self) -> int:
        return self.intake.active

    @property
    def control_feed(self) -> ControlFeed | None:
        """The control-plane subscription (None: no control_plane.addresses or shards)."""
        feed: ControlFeed | None = self._feed
        return feed

    @property
    def first_byte_yields(self) -> int:
        return self.relay.first_byte_yields

    @property
    def _yield_cpu(self) -> Callable[[], None] | None:
        return self.relay.yield_cpu

    @_yield_cpu.setter
    def _yield_cpu(self, fn: Callable[[], None] | None) -> None:
        self.relay.yield_cpu = fn

    def _dispatch(self, req: HttpRequest) -> Awaitable[Reply | None]:
        """The outbound listener's one handler: POST to an inference path, GET or HEAD
        /v1/models, and anything else to the pool unchanged. The layer's coroutine itself,
        not one awaiting it (one frame less on every resume)."""
        method = req.method
        if method == "POST" and req.path in PATH_KINDS:
            return self.intake.inference(req)
        if req.path == "/v1/models" and method in ("GET", "HEAD"):
            return self.intake.models(req)
        return self.intake.passthrough(req)

    def _intercepted_pool(self, req: HttpRequest) -> str | None:
        if self._transparent is None:
            return None
        pool: str | None = self._transparent.pool_for(req.transport)
        return pool

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        # Built before anything binds: a bad control_plane.tls file fails the start.
        if cfg.control_plane.shard_list() and self._feed is None:
            from meshd.control_feed import ControlFeed

            self._feed = ControlFeed(
                cfg, self.routers, self.metrics, on_restart=self.gate.engine_restarted
            )
            from meshd.control_feed import channel_credentials
            from meshd.demand_publisher import DemandPublisher

            self.demand_publisher = DemandPublisher(
                cfg, self.autoscale, credentials=channel_credentials(cfg)
            )
        for precise in self.precise.values():
            await precise.start()
        self.plane.upstream = UpstreamPool(
            connect_timeout_s=cfg.upstream.connect_timeout_s,
            keepalive_timeout_s=cfg.upstream.keepalive_timeout_s,
            max_connections_per_endpoint=cfg.upstream.max_connections_per_endpoint,
        )
        self.intake.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=cfg.upstream.connect_timeout_s),
            auto_decompress=False,
        )
        loop = asyncio.get_running_loop()
        out = cfg.listeners.outbound
        self._listener = await loop.create_server(
            self.server, out.host, out.port, backlog=1024, reuse_address=True
        )
        host, port = self._listener.sockets[0].getsockname()[:2]
        self.addresses["outbound"] = f"{host}:{port}"
        if cfg.listeners.transparent.enabled:
            await self._start_transparent()
        admin_app = build_admin_app(self)
        self._admin_runner = web.AppRunner(admin_app, access_log=None)
        await self._admin_runner.setup()
        adm = cfg.listeners.admin
        admin_site = web.TCPSite(self._admin_runner, adm.host, adm.port)
        await admin_site.start()
        sockets = getattr(admin_site._server, "sockets", None) or []
        host, port = sockets[0].getsockname()[:2]
        self.addresses["admin"] = f"{host}:{port}"
        if cfg.listeners.probes.enabled:
            await self._start_probes(admin_app[PROBES_APP])
        self._reaper = asyncio.create_task(self._reap())
        if self._feed is not None:
            await self._feed.start()
            if self.demand_publisher is not None:
                self.demand_publisher.start()
        elif cfg.routing.engine_metrics.enabled and cfg.routing.policy == "meshd":
            from meshd.engine_probe import EngineProbes

            self.probes = EngineProbes(
                cfg,
                self.routers,
                on_restart=self.gate.engine_restarted,
                on_metrics=self._engine_read,
                on_index_check=self._index_checked,
            )
            await self.probes.start()

    def _engine_read(self, url: str, now: float, m: EngineMetrics) -> None:
        """A scrape of an engine's /metrics: its busy-time counter, where it has one, to
        the cost ledger (filters/busy_time.py)."""
        if m.busy_seconds is not None:
            self.observer.engine_busy(url, now, m.busy_seconds, m.tokens)

    def _index_checked(self, pool: str, url: str, error: float) -> None:
        """The prefix index against the engine's own counters: the error on /metrics."""
        self.metrics.prefix_index_hit_error.labels(pool, url).set(error)

    async def _start_transparent(self) -> None:
        from meshd.transparent import start_transparent_listener

        cfg = self.config
        tl = cfg.listeners.transparent
        extra = {}
        if self._original_destination_fn is not None:
            extra["original_destination_fn"] = self._original_destination_fn
        self._transparent = await start_transparent_listener(
            tl.host,
            tl.port,
            {svc.key(): svc.pool for svc in cfg.transparent.services},
            self.server,
            connect_timeout_s=cfg.transparent.passthrough_connect_timeout_s,
            **extra,
        )
        self.addresses["transparent"] = f"{tl.host}:{self._transparent.port}"

    async def _start_probes(self, app: web.Application) -> None:
        """listeners.probes: /healthz and /readyz (and /metrics if asked) on their own port,
        so a kubelet can probe the pod IP while the admin listener stays on loopback."""
        probes = self.config.listeners.probes
        self._probe_runner = web.AppRunner(app, access_log=None)
        await self._probe_runner.setup()
        site = web.TCPSite(self._probe_runner, probes.host, probes.port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        host, port = sockets[0].getsockname()[:2]
        self.addresses["probes"] = f"{host}:{port}"

    async def drain_and_stop(self, on_closed: Callable[[], None] | None = None) -> None:
        """Stop accepting, let requests finish up to the grace period, then close.
        `on_closed` runs once the listeners are closed, before the wait."""
        self.draining = True
        if self._transparent is not None:
            self._transparent.close()
        if self._listener is not None:
            self._listener.close()
        if on_closed is not None:
            on_closed()
        await self.server.shutdown(self.config.drain.grace_period_s)
        if self._transparent is not None:
            await self._transparent.wait_closed()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self.demand_publisher is not None:
            await self.demand_publisher.close()
        if self._feed is not None:
            await self._feed.close()
        if self.probes is not None:
            await self.probes.close()
        for precise in self.precise.values():
            await precise.close()
        if self.intake.session is not None:
            await self.intake.session.close()
        if self.plane.upstream is not None:
            await self.plane.upstream.close()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
        if self._probe_runner is not None:
            await self._probe_runner.cleanup()
        self.relay.attempts.deadlines.close()
        self.accounting.flush()
        if self.plane.cache is not None:
            await self.plane.cache.aclose()
        await self.observer.aclose()

    async def _reap(self) -> None:
        """Every _REAPER_PERIOD_S: close relays silent for upstream.idle_timeout_s or past
        their deadline; tick the guards and the observer."""
        loop = asyncio.get_running_loop()
        idle = self.config.upstream.idle_timeout_s
        while True:
            await asyncio.sleep(_REAPER_PERIOD_S)
            now = loop.time()
            for w in list(self.plane.watches):
                if w.expired is None and now - w.last_activity > idle:
                    w.expired = "idle"
                elif w.expired is None and now > w.deadline:
                    w.expired = "deadline"
                else:
                    continue
                w.upstream.close()
            self.gate.tick(time.monotonic())
            self.autoscale.evaluate(time.monotonic())
            self.observer.tick(now)


# -- command line ----------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "sidecar",
        help="run the outbound sidecar proxy",
        description="Run the meshd sidecar: an OpenAI-compatible proxy that relays "
        "/v1/completions, /v1/chat/completions, /v1/embeddings and /v1/models to a pool of "
        "engines (vLLM, SGLang), streaming SSE chunk by chunk. Prints one JSON line "
        '{"event": "ready", ...} with the bound addresses once it listens. SIGTERM drains: '
        "no new connections, running streams get drain.grace_period_s to finish.",
        epilog="Example: meshd sidecar --upstream http://127.0.0.1:8000 --listen 127.0.0.1:15001",
    )
    p.add_argument(
        "--config", "-c", metavar="FILE", help="YAML config file (see `meshd config example`)"
    )
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="an engine URL for the default pool (repeatable); replaces the config's pools",
    )
    p.add_argument("--listen", metavar="HOST:PORT", help="outbound listener address")
    p.add_argument(
        "--admin", metavar="HOST:PORT", help="admin listener address (loopback by default)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one config key, e.g. --set limits.max_body_bytes=1048576",
    )
    p.set_defaults(func=run)


def _split_hostport(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError([f"{flag}: expected HOST:PORT, got {value!r}"], "command line")
    return host.strip("[]") or "127.0.0.1", int(port)


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = list(args.set)
    if args.upstream:
        # Applied after the file, so --upstream replaces the file's pools.
        pools = [{"name": "default", "endpoints": list(args.upstream)}]
        overrides.insert(0, "pools=" + json.dumps(pools))
    for flag, key in (("--listen", "outbound"), ("--admin", "admin")):
        value = getattr(args, flag.lstrip("-"))
        if value:
            host, port = _split_hostport(value, flag)
            overrides += [f"listeners.{key}.host={host}", f"listeners.{key}.port={port}"]
    return load_config(args.config, overrides=overrides)


async def serve(config: Config, ready: asyncio.Event | None = None) -> int:
    sidecar = Sidecar(config)
    try:
        await sidecar.start()
    except BaseException:
        with contextlib.suppress(Exception):  # close what did start, then say why
            await sidecar.drain_and_stop()
        raise
    # Started: what start-up built lives as long as the process; no collection walks it
    # again (a full one stalled the event loop 44-274 ms every ~10-15 s following 1,000
    # engines at 10 Hz; 2-7 ms since; meshd/heap.py, loadtest/gc_pause_bench.py).
    frozen = settle()
    log.info("froze %d objects built at start", frozen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        json.dumps(
            {
                "event": "ready",
                "version": __version__,
                "hot_path": IMPLEMENTATION,
                **sidecar.addresses,
            }
        ),
        flush=True,
    )
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("draining (grace period %.1f s)", config.drain.grace_period_s)
    await sidecar.drain_and_stop(
        lambda: print(json.dumps({"event": "draining", "active": sidecar.active}), flush=True)
    )
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvloop

    try:
        return uvloop.run(serve(config))
    except ConfigError as exc:  # found only at start: a TLS file that cannot be read
        print(exc.render(), file=sys.stderr)
        return 1
    except OSError as exc:  # a listener that cannot bind (port in use, no permission)
        print(f"meshd sidecar: cannot start: {exc}", file=sys.stderr)
        return 1
