"""`meshd agent`: runs next to one engine (vLLM or SGLang), scrapes its /metrics and /health,
follows its KV events (ZMQ SUB, with replay after a gap: meshd/kv_events.py's
KVEventSubscriber, the one the precise prefix path uses, feeding a KVDigestTracker), reads
its GPUs through NVML when there are any, and publishes EndpointState and PrefixDigest to
every control plane.

Publishing is per tick (`interval_s`), not per change: KV events only move the tracker, and
each tick offers at most one EndpointState (when it changed, or as a heartbeat) and one
digest (cumulative since its base). Each control plane's link sends what is offered as one
message per type, and what is offered while a send is in flight replaces what was waiting
(latest wins), so a slow control plane gets fewer, newer updates.

The decisions are in filters/vllm_metrics.py and filters/kv_digest.py; this file is I/O.
Nothing here may crash the agent: an engine that stops answering is published unhealthy,
a control plane that is down is retried with backoff, each on its own.

Traces (OTLP, when --otlp-endpoint is set): a span per tick that published something (the
scrape, the state and digest it sent), a span per KV-event replay and per new epoch; quiet
ticks make none, so an idle engine costs a span per heartbeat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import grpc
import zmq.asyncio

from filters.gpu import normalise_gpu_name
from filters.kv_digest import Digest, KVDigestTracker
from filters.vllm_metrics import (
    EngineMetrics,
    Flavor,
    MetricsParseError,
    MetricsTracker,
    parse_engine_metrics,
)
from meshd import telemetry
from meshd.kv_events import KVEventSubscriber, SubscriberStats
from meshd.tasks import cancel_and_wait
from xds.client import Backoff, Publisher, tls_channel_credentials
from xds.resources import ENDPOINT_STATE_TYPE, PREFIX_DIGEST_TYPE, EndpointState, PrefixDigest

__all__ = [
    "AgentConfig",
    "AgentStats",
    "EngineAgent",
    "GpuReading",
    "channel_credentials",
    "read_nvml",
    "register",
]

log = logging.getLogger("meshd.agent")


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything `meshd agent` takes (flags of the same names)."""

    name: str
    engine_url: str
    address: str
    control_planes: tuple[str, ...]
    pool: str = ""
    model: str = ""
    flavor: Flavor | None = None
    interval_s: float = 0.1
    heartbeat_s: float = 2.0
    scrape_timeout_s: float = 0.5
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    # vLLM connects its PUB to a concrete tcp:// address; then the agent must bind.
    kv_events_bind: bool = False
    replay_timeout_s: float = 1.0
    resync_s: float = 30.0
    gpu: str | None = None
    gpu_count: int = 0
    memory_total_bytes: int | None = None
    nvml: bool = True
    gpu_indices: tuple[int, ...] = ()
    backoff: Backoff = field(default_factory=lambda: Backoff(base_s=0.1, max_s=5.0))
    otlp_endpoint: str | None = None  # host:port of an OTLP/gRPC collector; None: no spans
    trace_sample_ratio: float = 1.0
    service_name: str = "meshd-agent"
    # TLS to the control planes (PEM files): the CA that signed their certificates, and
    # this agent's client certificate and key where they verify clients (mTLS).
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None


def channel_credentials(config: AgentConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for the publish channels, or None for plaintext. ValueError names
    the setting (the CLI flag of the same name) of a file that cannot be read."""
    if config.tls_ca_file is None and config.tls_cert_file is None and config.tls_key_file is None:
        return None
    if (config.tls_cert_file is None) != (config.tls_key_file is None):
        raise ValueError("tls_cert_file and tls_key_file (--tls-cert, --tls-key) go together")
    return tls_channel_credentials(
        config.tls_ca_file, config.tls_cert_file, config.tls_key_file, prefix="tls_"
    )


@dataclass(slots=True)
class AgentStats:
    scrapes: int = 0
    scrape_failures: int = 0
    epochs: int = 1
    publishes: int = 0  # resources sent
    publish_messages: int = 0  # publish messages (one per type per send)
    publish_failures: int = 0
    kv: SubscriberStats = field(default_factory=SubscriberStats)  # the KV event subscriber's

    @property
    def kv_batches(self) -> int:
        return self.kv.messages

    @property
    def kv_bad_payloads(self) -> int:
        return self.kv.bad_frames + self.kv.bad_payloads

    @property
    def replays(self) -> int:
        return self.kv.replays


@dataclass(frozen=True, slots=True)
class GpuReading:
    name: str
    count: int
    memory_total_bytes: int
    memory_used_bytes: int


_nvml_state: dict[str, bool] = {}


def read_nvml(indices: Sequence[int] = ()) -> GpuReading | None:
    """The engine's GPUs through NVML (`nvidia-ml-py`, an optional extra), or None when it
    is not installed or there is no GPU. NVML is initialised once, at the first call."""
    if _nvml_state.get("failed"):
        return None
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        _nvml_state["failed"] = True
        return None
    try:
        if not _nvml_state.get("ready"):
            pynvml.nvmlInit()
            _nvml_state["ready"] = True
        n = pynvml.nvmlDeviceGetCount()
        wanted = [i for i in indices if 0 <= i < n] if indices else list(range(n))
        if not wanted:
            return None
        name, total, used = "", 0, 0
        for i in wanted:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            raw = pynvml.nvmlDeviceGetName(h)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            total += int(mem.total)
            used += int(mem.used)
        return GpuReading(normalise_gpu_name(name), len(wanted), total, used)
    except Exception as exc:  # NVMLError (no driver, no GPU): fall back to config for good
        log.info("NVML unavailable (%s); GPU facts come from flags", exc)
        _nvml_state["failed"] = True
        return None


class _Link:
    """One control plane: the latest body of each resource, sent by its own task, so a
    control plane that is down or slow never holds up the others.

    Bodies offered while a send is in flight or the control plane is away coalesce to the
    latest, except that a body later ones build on (a full PrefixDigest: the deltas after
    it are relative to it) is never displaced by them unsent: it goes first, then the
    newest delta, so the control plane never holds a delta whose base it was not given."""

    def __init__(self, agent: EngineAgent, target: str) -> None:
        self.agent = agent
        self.target = target
        self.connected = False
        self._pending: dict[tuple[str, str], bytes] = {}
        self._bases: set[tuple[str, str]] = set()  # pending bodies that later ones build on
        self._first: dict[tuple[str, str], bytes] = {}  # displaced bases, sent before pending
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._rng = random.Random()

    def offer(self, type_url: str, name: str, body: bytes, *, base: bool = False) -> None:
        """`base`: bodies offered later for this resource build on this one."""
        self._put((type_url, name), body, base)
        self._wake.set()

    def _put(self, key: tuple[str, str], body: bytes, base: bool) -> None:
        if base:
            self._first.pop(key, None)  # a newer base supersedes everything before it
            self._bases.add(key)
        elif key in self._bases:
            self._first[key] = self._pending[key]
            self._bases.discard(key)
        self._pending[key] = body

    def _requeue(
        self,
        first: dict[tuple[str, str], bytes],
        batch: dict[tuple[str, str], bytes],
        bases: set[tuple[str, str]],
    ) -> None:
        """Put back what did not go, in front of what was offered meanwhile (replayed on
        top, so newer bodies win and a newer base supersedes the old ones)."""
        newer = self._first, self._pending, self._bases
        self._first, self._pending, self._bases = dict(first), dict(batch), set(bases)
        newer_first, newer_pending, newer_bases = newer
        for key, body in newer_pending.items():
            if key in newer_first:
                self._put(key, newer_first[key], True)
            self._put(key, body, key in newer_bases)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        # The flag as well as the cancel: a cancel that lands as an await completes can
        # be lost (3.11's wait_for returned the result instead), and the loop must still end.
        self._closed = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _publish(self, publisher: Publisher, batch: dict[tuple[str, str], bytes]) -> None:
        by_type: dict[str, dict[str, bytes]] = {}
        for (type_url, name), body in batch.items():
            by_type.setdefault(type_url, {})[name] = body
        for type_url, resources in by_type.items():
            # asyncio.timeout, not wait_for: see close().
            async with asyncio.timeout(5.0):
                await publisher.publish(type_url, resources)
            self.agent.stats.publish_messages += 1
        self.agent.stats.publishes += len(batch)

    async def _run(self) -> None:
        attempt = 0
        publisher: Publisher | None = None
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._closed:
                    return
                first, self._first = self._first, {}
                batch, self._pending = self._pending, {}
                bases, self._bases = self._bases, set()
                if publisher is None:
                    publisher = Publisher(self.target, credentials=self.agent.credentials)
                try:
                    if first:
                        await self._publish(publisher, first)
                        first = {}
                    await self._publish(publisher, batch)
                    if not self.connected:
                        self.connected = True
                        log.info("publishing to the control plane %s", self.target)
                    attempt = 0
                except Exception as exc:
                    self.agent.stats.publish_failures += 1
                    if self.connected:
                        log.warning("control plane %s: %s; retrying", self.target, exc)
                    self.connected = False
                    with contextlib.suppress(Exception):
                        await publisher.close()
                    publisher = None
                    # Keep what did not go, and make the next digest full: this control
                    # plane may have lost the base.
                    self._requeue(first, batch, bases)
                    self.agent.on_link_lost()
                    await asyncio.sleep(self.agent.config.backoff.delay(attempt, self._rng))
                    attempt += 1
                    self._wake.set()
        finally:  # closed, or cancelled: either way the channel goes
            if publisher is not None:
                with contextlib.suppress(Exception):
                    await publisher.close()


class EngineAgent:
    """The agent of one engine. `start()`, then `close()`; `state` and `tracker` are its
    current view (tests and /metrics read them)."""

    def __init__(self, config: AgentConfig, *, tracer_provider: Any = None) -> None:
        """tracer_provider: an OpenTelemetry TracerProvider (tests pass one); else one is
        made for config.otlp_endpoint, else no spans."""
        self.config = config
        self.credentials = channel_credentials(config)  # ValueError names a bad TLS file
        self._own_provider = tracer_provider is None and config.otlp_endpoint is not None
        if self._own_provider:
            tracer_provider = telemetry.setup_tracing(
                config.service_name, config.otlp_endpoint, config.trace_sample_ratio
            )
        self._provider = tracer_provider
        self._tracer = tracer_provider.get_tracer("meshd.agent") if tracer_provider else None
        self.stats = AgentStats()
        self.epoch = self._new_epoch()
        self.metrics = MetricsTracker()
        self.tracker = KVDigestTracker(config.name, self.epoch, resync_s=config.resync_s)
        self.state: EndpointState | None = None
        self.last_metrics: EngineMetrics | None = None
        self.healthy = False
        self._was_healthy: bool | None = None
        self._published_state: EndpointState | None = None
        self._published_at = float("-inf")
        self._links = [_Link(self, t) for t in config.control_planes]
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._zmq = zmq.asyncio.Context()
        self._changed = asyncio.Condition()
        self.kv_events: KVEventSubscriber | None = None
        if config.kv_events:
            self.kv_events = KVEventSubscriber(
                self.tracker,
                config.kv_events,
                replay=config.kv_events_replay,
                topic=config.kv_events_topic,
                bind=config.kv_events_bind,
                context=self._zmq,
                replay_timeout_s=config.replay_timeout_s,
                on_restart=lambda: self.new_epoch("KV event sequence restarted"),
                on_replay=self._on_replay,
            )
            self.stats.kv = self.kv_events.stats

    @staticmethod
    def _new_epoch() -> str:
        return uuid.uuid4().hex[:16]

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.scrape_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout)
        for link in self._links:
            link.start()
        self._tasks.append(asyncio.ensure_future(self._scrape_loop()))
        if self.kv_events is not None:
            await self.kv_events.start()

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        if self.kv_events is not None:
            await self.kv_events.close()
        for link in self._links:
            await link.close()
        if self._session is not None:
            await self._session.close()
        self._zmq.destroy(linger=0)
        if self._own_provider:
            await asyncio.get_running_loop().run_in_executor(None, self._provider.shutdown)

    async def __aenter__(self) -> EngineAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def on_link_lost(self) -> None:
        self.tracker.force_full()

    async def wait_until(self, predicate: Any) -> None:
        async with self._changed:
            await self._changed.wait_for(predicate)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- epochs ---------------------------------------------------------------------------

    def new_epoch(self, why: str) -> None:
        if self._tracer is not None:
            attrs = {
                telemetry.ATTR_ENGINE: self.config.name,
                telemetry.ATTR_EPOCH: self.epoch,
                telemetry.ATTR_REASON: why,
            }
            self._tracer.start_span(telemetry.SPAN_AGENT_EPOCH, attributes=attrs).end()
        self.epoch = self._new_epoch()
        self.stats.epochs += 1
        self.metrics = MetricsTracker()
        self.tracker.set_epoch(self.epoch)
        log.info("engine %s: new epoch %s (%s)", self.config.name, self.epoch, why)

    # -- scraping -------------------------------------------------------------------------

    async def _get(self, path: str) -> tuple[int, str]:
        assert self._session is not None
        async with self._session.get(self.config.engine_url.rstrip("/") + path) as r:
            return r.status, await r.text()

    async def _scrape(self) -> EngineMetrics | None:
        try:
            (hs, _), (ms, text) = await asyncio.gather(self._get("/health"), self._get("/metrics"))
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.debug("engine %s unreachable: %s", self.config.engine_url, exc)
            return None
        if hs != 200 or ms != 200:
            return None
        try:
            return parse_engine_metrics(text, self.config.flavor)
        except MetricsParseError as exc:
            log.warning("engine %s: unreadable /metrics: %s", self.config.engine_url, exc)
            return None

    def _build_state(self, m: EngineMetrics | None, healthy: bool) -> EndpointState:
        cfg = self.config
        gpu = read_nvml(cfg.gpu_indices) if cfg.nvml else None
        prev = self.state
        if m is None:
            # Keep the last figures; only health says anything now.
            base = prev or EndpointState(address=cfg.address, pool=cfg.pool, model=cfg.model)
            return replace(base, healthy=False, epoch=self.epoch)
        return EndpointState(
            address=cfg.address,
            pool=cfg.pool,
            model=cfg.model or m.model or "",
            gpu=gpu.name if gpu else (cfg.gpu or m.gpu),
            gpu_count=gpu.count if gpu else cfg.gpu_count,
            memory_total_bytes=gpu.memory_total_bytes if gpu else cfg.memory_total_bytes,
            memory_used_bytes=gpu.memory_used_bytes if gpu else None,
            kv_block_size=m.kv_block_size,
            kv_capacity_blocks=m.kv_capacity_blocks,
            kv_usage=m.kv_usage,
            requests_running=m.running,
            requests_waiting=m.waiting,
            ttft_s=self.metrics.ttft_s,
            tpot_s=self.metrics.tpot_s,
            healthy=healthy,
            epoch=self.epoch,
        )

    async def tick(self) -> None:
        """One scrape, and the publishes it calls for."""
        started_ns = time.time_ns()
        m = await self._scrape()
        now = time.monotonic()
        self.stats.scrapes += 1
        healthy = m is not None
        if m is None:
            self.stats.scrape_failures += 1
        else:
            update = self.metrics.update(m)
            if update.counters_reset:
                self.new_epoch("engine counters went backwards")
                self.metrics.update(m)
            elif self._was_healthy is False:
                # Down and back: maybe a restart whose counters we never saw fall.
                self.new_epoch("engine recovered")
                self.metrics.update(m)
            if m.kv_block_size and not self.tracker.blocks:
                self.tracker.block_size = m.kv_block_size
            self.last_metrics = m
        self._was_healthy = healthy
        self.healthy = healthy
        self.state = self._build_state(m, healthy)
        published = (
            self.state != self._published_state
            or now - self._published_at >= self.config.heartbeat_s
        )
        if published:
            self._offer(ENDPOINT_STATE_TYPE, self.state.encode())
            self._published_state, self._published_at = self.state, now
        digest = self.publish_digest(now)
        if self._tracer is not None and (published or digest is not None):
            self._trace_tick(started_ns, published, digest)
        await self._notify()

    def _trace_tick(self, started_ns: int, published: bool, digest: Digest | None) -> None:
        assert self._tracer is not None and self.state is not None
        st = self.state
        attrs: dict[str, Any] = {
            telemetry.ATTR_ENGINE: self.config.name,
            telemetry.ATTR_POOL: st.pool,
            telemetry.ATTR_EPOCH: self.epoch,
            telemetry.ATTR_HEALTHY: st.healthy,
            telemetry.ATTR_STATE_PUBLISHED: published,
        }
        if st.model:
            attrs[telemetry.GEN_AI_REQUEST_MODEL] = st.model
        for key, v in (
            (telemetry.ATTR_REQUESTS_RUNNING, st.requests_running),
            (telemetry.ATTR_REQUESTS_WAITING, st.requests_waiting),
            (telemetry.ATTR_KV_USAGE, st.kv_usage),
        ):
            if v is not None:
                attrs[key] = v
        if digest is not None:
            attrs[telemetry.ATTR_DIGEST_SEQ] = digest.seq
            attrs[telemetry.ATTR_DIGEST_FULL] = digest.full
            attrs[telemetry.ATTR_DIGEST_ADDED] = len(digest.added)
            attrs[telemetry.ATTR_DIGEST_REMOVED] = len(digest.removed)
        span = self._tracer.start_span(
            telemetry.SPAN_AGENT_PUBLISH, start_time=started_ns, attributes=attrs
        )
        if not st.healthy:
            span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, "engine unhealthy"))
        span.end()

    def publish_digest(self, now: float) -> Digest | None:
        d = self.tracker.digest(now)
        if d is not None:
            # A full digest is the base of the deltas after it (xds/resources.py).
            self._offer(PREFIX_DIGEST_TYPE, _to_resource(d).encode(), base=d.full)
        return d

    def _offer(self, type_url: str, body: bytes, *, base: bool = False) -> None:
        for link in self._links:
            link.offer(type_url, self.config.name, body, base=base)

    async def _scrape_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must cost one tick, not the agent
                log.exception("agent tick failed")
            next_at = max(next_at + self.config.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    # -- KV events ------------------------------------------------------------------------

    def _on_replay(self, start_seq: int, replayed: int, lost: bool, started_ns: int) -> None:
        """A span per replay (the subscriber logs a lost gap itself)."""
        if self._tracer is None:
            return
        span = self._tracer.start_span(
            telemetry.SPAN_AGENT_KV_REPLAY,
            start_time=started_ns,
            attributes={
                telemetry.ATTR_ENGINE: self.config.name,
                telemetry.ATTR_REPLAY_FROM: start_seq,
                telemetry.ATTR_REPLAYED: replayed,
                telemetry.ATTR_REPLAY_LOST: lost,
            },
        )
        if lost:
            span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, "gap lost"))
        span.end()


def _to_resource(d: Digest) -> PrefixDigest:
    return PrefixDigest(
        engine=d.engine,
        epoch=d.epoch,
        seq=d.seq,
        base_seq=d.base_seq,
        full=d.full,
        block_size=d.block_size,
        added=d.added,
        removed=d.removed,
    )


# -- CLI ----------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "agent",
        help="publish one engine's state and KV-cache digest to the control plane",
        description="Run next to a vLLM or SGLang engine: scrape its /metrics and /health, "
        "follow its KV events (ZMQ), read its GPUs via NVML when present, and publish "
        "EndpointState and PrefixDigest to every --control-plane.",
    )
    p.add_argument("--engine", default="http://127.0.0.1:8000", help="engine base URL")
    p.add_argument("--name", required=True, help="the engine's resource name")
    p.add_argument("--address", help="host:port clients reach the engine at (default: --engine)")
    p.add_argument("--pool", default="")
    p.add_argument("--model", default="", help="default: the engine's model_name label")
    p.add_argument("--flavor", choices=("vllm", "sglang"), help="default: detect")
    p.add_argument(
        "--control-plane", action="append", default=[], metavar="HOST:PORT", required=True
    )
    p.add_argument("--interval", type=float, default=0.1, help="seconds between scrapes")
    p.add_argument("--heartbeat", type=float, default=2.0, help="republish at least this often")
    p.add_argument("--scrape-timeout", type=float, default=0.5)
    p.add_argument("--kv-events", metavar="ENDPOINT", help="the engine's KV event PUB endpoint")
    p.add_argument("--kv-events-replay", metavar="ENDPOINT", help="its replay ROUTER endpoint")
    p.add_argument("--kv-events-topic", default="")
    p.add_argument(
        "--kv-events-bind",
        action="store_true",
        help="bind the SUB socket (when vLLM's endpoint is a concrete tcp:// address, it "
        "connects to it)",
    )
    p.add_argument("--resync", type=float, default=30.0, help="seconds between full digests")
    p.add_argument("--gpu", help="GPU generation when NVML cannot tell (H100, A100, ...)")
    p.add_argument("--gpu-count", type=int, default=0)
    p.add_argument("--gpu-memory-gib", type=float, help="total GPU memory when NVML cannot tell")
    p.add_argument("--gpu-index", type=int, action="append", default=[], help="NVML indices")
    p.add_argument("--no-nvml", action="store_true")
    p.add_argument(
        "--tls-ca", metavar="PEM", help="CA of the control planes' certificates (TLS on)"
    )
    p.add_argument(
        "--tls-cert", metavar="PEM", help="client certificate, for control planes that verify"
    )
    p.add_argument("--tls-key", metavar="PEM", help="the client certificate's private key")
    p.add_argument("--otlp-endpoint", metavar="HOST:PORT", help="export traces over OTLP/gRPC")
    p.add_argument(
        "--trace-sample-ratio", type=float, default=1.0, help="share of traces kept (0..1)"
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    address = args.address or args.engine.split("://", 1)[-1].rstrip("/")
    mem = args.gpu_memory_gib
    return AgentConfig(
        name=args.name,
        engine_url=args.engine,
        address=address,
        control_planes=tuple(args.control_plane),
        pool=args.pool,
        model=args.model,
        flavor=args.flavor,
        interval_s=args.interval,
        heartbeat_s=args.heartbeat,
        scrape_timeout_s=args.scrape_timeout,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        kv_events_topic=args.kv_events_topic,
        kv_events_bind=args.kv_events_bind,
        resync_s=args.resync,
        gpu=args.gpu,
        gpu_count=args.gpu_count,
        memory_total_bytes=int(mem * 2**30) if mem is not None else None,
        nvml=not args.no_nvml,
        gpu_indices=tuple(args.gpu_index),
        otlp_endpoint=args.otlp_endpoint,
        trace_sample_ratio=args.trace_sample_ratio,
        tls_ca_file=args.tls_ca,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = config_from_args(args)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            agent = EngineAgent(config)
        except ValueError as exc:  # a TLS file named by a flag
            raise SystemExit(f"meshd agent: {exc}") from None
        async with agent:
            print(f"meshd agent for {config.name} ({config.engine_url})", flush=True)
            await stop.wait()

    asyncio.run(serve())
    return 0
