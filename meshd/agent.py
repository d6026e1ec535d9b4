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

The decisions are in filters/vllm_metrics.py and filters/kv_digest.py; this file is I/O,
with one control plane's link in meshd/agent_link.py, the GPUs read in meshd/nvml.py and the
command line in meshd/agent_cmd.py.
Nothing here may crash the agent: an engine that stops answering is published unhealthy,
a control plane that is down is retried with backoff, each on its own.

Traces (OTLP, when --otlp-endpoint is set): a span per tick that published something (the
scrape, the state and digest it sent), a span per KV-event replay and per new epoch; quiet
ticks make none, so an idle engine costs a span per heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import grpc
import zmq.asyncio

from filters.kv_digest import Digest, KVDigestTracker
from filters.vllm_metrics import (
    EngineMetrics,
    Flavor,
    MetricsParseError,
    MetricsTracker,
    parse_engine_metrics,
)
from meshd import telemetry
from meshd.agent_link import ControlPlaneLink
from meshd.kv_events import KVEventSubscriber, SubscriberStats
from meshd.nvml import read_nvml
from meshd.tasks import cancel_and_wait
from xds.client import Backoff, tls_channel_credentials, tls_client_context
from xds.resources import ENDPOINT_STATE_TYPE, PREFIX_DIGEST_TYPE, EndpointState, PrefixDigest

__all__ = [
    "AgentConfig",
    "AgentStats",
    "EngineAgent",
    "channel_credentials",
    "client_ssl_context",
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
    # Publish over the control plane's frames port once it advertises one (a fifth of the
    # control plane's CPU a message: xds/publish_frames.py); off: gRPC only.
    publish_frames: bool = True


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


def client_ssl_context(config: AgentConfig) -> ssl.SSLContext | None:
    """The same TLS for the frames publish port (None: plaintext, as the channels)."""
    if config.tls_ca_file is None and config.tls_cert_file is None and config.tls_key_file is None:
        return None
    return tls_client_context(
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


class EngineAgent:
    """The agent of one engine. `start()`, then `close()`; `state` and `tracker` are its
    current view (tests and /metrics read them)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        tracer_provider: Any = None,
        links: list[ControlPlaneLink] | None = None,
    ) -> None:
        """tracer_provider: an OpenTelemetry TracerProvider (tests pass one); else one is
        made for config.otlp_endpoint, else no spans. links: the control-plane links of a
        NodeAgent, shared with its other engines (started and closed by it); else the
        agent's own, one per config.control_planes."""
        self.config = config
        self.credentials = channel_credentials(config)  # ValueError names a bad TLS file
        self.ssl_context = client_ssl_context(config)
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
        self._own_links = links is None
        self._links = (
            [ControlPlaneLink(self, t) for t in config.control_planes] if links is None else links
        )
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
        if self._own_links:
            for link in self._links:
                link.start()
        self._tasks.append(asyncio.ensure_future(self._scrape_loop()))
        if self.kv_events is not None:
            await self.kv_events.start()

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        if self.kv_events is not None:
            await self.kv_events.close()
        if self._own_links:
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
