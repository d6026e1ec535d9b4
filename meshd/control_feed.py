"""The sidecar's subscription to the control plane: engines' EndpointState and PrefixDigest
(delta ADS, xds/client.py) into the pools' routers (filters/pool_router.py).

Which engines are ours: an engine counts when its `address` is the host:port of one of a
pool's endpoint URLs; its PrefixDigest is then subscribed by name. EndpointState is
subscribed by name when every endpoint names its engine (`pools[].endpoints[].engine`, the
resource name its agent publishes under), so the sidecar receives its pools' engines
alone; else with the wildcard (every engine of the fleet, matched by address).

Static stability: the feed never sits on the request path. While a stream to a replica is
open the reports are renewed every `refresh_s` (the control plane holds the engines'
latest state; it removes an engine whose agent went quiet); once the stream is lost the
reports age and, `control_plane.stale_after_s` later, go stale: the routers fall back to
what the sidecar observes itself, and digests leave the prefix index. Meanwhile the
subscriber reconnects with jittered backoff, moving through `control_plane.addresses`.

Its health is in `health()` (for /readyz detail) and in the sidecar's metrics registry
(`ControlFeedCollector`, names below).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from filters.endpoint_state import EndpointState, ReportedState
from filters.pool_router import PickerRouter, PoolRouter
from meshd.config import Config, ConfigError
from meshd.metrics import DataPlaneMetrics
from meshd.shards import shard_for
from meshd.tasks import cancel_and_wait
from xds.client import (
    Backoff,
    Entry,
    Subscriber,
    Update,
    tls_channel_credentials,
    tls_client_context,
)
from xds.engine_report import EngineReport, decode_engine_report
from xds.resources import (
    ENDPOINT_STATE_TYPE,
    PREFIX_DIGEST_TYPE,
    PrefixDigest,
    decode_prefix_digest,
)

__all__ = [
    "ControlFeed",
    "ControlFeedCollector",
    "FeedStats",
    "channel_credentials",
    "subscribed_engines",
]

log = logging.getLogger("meshd.control_feed")

# Renew reports this often (at most) while connected: well inside stale_after_s.
MAX_REFRESH_S = 1.0
# Published addresses remembered with the endpoints they name (one per engine followed);
# past this many the memo starts over, so addresses that keep changing cannot grow it.
MAX_ADDRESSES = 65_536

# An endpoint an engine reports for: its pool, its URL, and that pool router's `report`.
Target = tuple[str, str, Callable[..., bool]]


def channel_credentials(config: Config) -> grpc.ChannelCredentials | None:
    """TLS (and, with a client certificate, mTLS) credentials from `control_plane.tls`;
    None for plaintext. A file that cannot be read is a ConfigError naming its key."""
    tls = config.control_plane.tls
    if tls is None:
        return None
    try:
        return tls_channel_credentials(
            tls.ca_file, tls.cert_file, tls.key_file, prefix="control_plane.tls."
        )
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None


def frames_ssl_context(config: Config) -> ssl.SSLContext | None:
    """The same TLS as channel_credentials for the frames port (None: plaintext)."""
    tls = config.control_plane.tls
    if tls is None:
        return None
    try:
        return tls_client_context(
            tls.ca_file, tls.cert_file, tls.key_file, prefix="control_plane.tls."
        )
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None


def _host_port(url: str) -> str:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port}"


def subscribed_engines(config: Config, routers: Mapping[str, PoolRouter]) -> list[str] | None:
    """The EndpointState resource names to subscribe to: every endpoint's `engine` in the
    pools routed here, or None (the wildcard) unless each of them names one."""
    names: set[str] = set()
    for pool in config.pools:
        if pool.name not in routers:
            continue
        for ep in pool.endpoints:
            if ep.engine is None:
                return None
            names.add(ep.engine)
    return sorted(names)


def _address_key(address: str) -> str:
    """An EndpointState address ("host:port", maybe with a scheme) in _host_port's form."""
    if "://" not in address:
        address = "http://" + address
    try:
        return _host_port(address)
    except ValueError:
        return address


@dataclass(slots=True)
class FeedStats:
    """What the feed applied (the subscriber's own counters are in `Subscriber.stats`)."""

    updates: Counter[str] = field(default_factory=Counter)  # resources applied, by type
    removals: Counter[str] = field(default_factory=Counter)
    unmatched: int = 0  # EndpointStates of engines that are none of our endpoints
    digests_ignored: int = 0  # digests whose base this sidecar never saw
    refreshes: int = 0


class ControlFeed:
    """Feeds the control plane's engine state into the sidecar's routers (one per pool)."""

    def __init__(
        self,
        config: Config,
        routers: Mapping[str, PoolRouter],
        metrics: DataPlaneMetrics,
        *,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_restart: Callable[[str, str, float], None] | None = None,
    ) -> None:
        """`on_restart(pool, url, now)`: an engine's report came with a new epoch (it
        restarted, its cache is empty); the sidecar ramps it back in (slow start)."""
        cp = config.control_plane
        shards = cp.shard_list()
        if not shards:
            raise ConfigError(["control_plane.addresses: at least one address is needed"])
        self.stale_after_s = cp.stale_after_s
        self.refresh_s = min(MAX_REFRESH_S, cp.stale_after_s / 4)
        self.routers = routers
        self.metrics = metrics
        self.stats = FeedStats()
        self._clock = clock
        # "host:port" -> the endpoints there, one tuple per address (compared by identity).
        targets: dict[str, list[Target]] = {}
        for pool in config.pools:
            router = routers.get(pool.name)
            if router is None:
                continue
            for ep in pool.endpoints:
                targets.setdefault(_host_port(ep.url), []).append(
                    (pool.name, ep.url, router.report)
                )
        self._targets = {k: tuple(v) for k, v in targets.items()}
        # A published address, as it came -> its targets (_targets_at).
        self._by_address: dict[str, tuple[Target, ...]] = {}
        self._engines: dict[str, tuple[Target, ...]] = {}  # resource name -> its targets
        self._reports: dict[str, ReportedState] = {}  # resource name -> last state
        self._on_restart = on_restart
        self._digest_names: set[str] = set()
        # One subscriber per control-plane shard (control_plane.shards; `addresses` is one
        # shard), each failing over among its replicas. An engine is in one shard, but
        # while shards are added it may be in two for a while (its agent moved; the old
        # shard forgets it after its resource TTL): it is gone only when no shard has it.
        credentials = channel_credentials(config)
        ssl_context = frames_ssl_context(config) if cp.frames else None
        wanted = subscribed_engines(config, routers)
        # Named engines: each shard is asked only for those that hash to it (their agents
        # publish nowhere else: meshd/shards.py), instead of every shard for all of them.
        per_shard: list[list[str] | None] = [wanted] * len(shards)
        if wanted is not None and len(shards) > 1:
            split: list[list[str]] = [[] for _ in shards]
            for name in wanted:
                split[shards.index(shard_for(name, shards))].append(name)
            per_shard = list(split)
        self._subs = [
            Subscriber(
                replicas,
                {ENDPOINT_STATE_TYPE: per_shard[k], PREFIX_DIGEST_TYPE: ()},
                node_id=cp.node_id or socket.gethostname(),
                decoders={
                    ENDPOINT_STATE_TYPE: decode_engine_report,
                    PREFIX_DIGEST_TYPE: decode_prefix_digest,
                },
                credentials=credentials,
                backoff=backoff or Backoff(base_s=0.25, max_s=10.0),
                on_update=self._on_update if len(shards) == 1 else self._shard_handler(k),
                clock=clock,
                # EndpointState responses ACKed at most every control_plane.ack_pace_s
                # (20 ms), so the control plane sends one at most that often, carrying every
                # engine changed meanwhile: a response's fixed cost (gRPC's read and write,
                # ~170 us on the project's VM) is shared by that many updates instead of the
                # few of one event-loop turn. What it costs: an engine's state reaches the
                # routers up to that much later (engines report every 100 ms at most; the
                # picker routes on its own observations in between).
                # loadtest/xds_apply_bench.py (b) measures it.
                ack_pace_s={ENDPOINT_STATE_TYPE: cp.ack_pace_s},
                # Over the control plane's frames port once it says where that is: gRPC's
                # read and ACK cost ~400-800 us a response besides (xds/client.py).
                frames=cp.frames,
                ssl_context=ssl_context,
            )
            for k, replicas in enumerate(shards)
        ]
        self._sub = self._subs[0]
        self._holders: dict[str, set[int]] = {}  # resource name -> the shards that hold it
        self._pending_digests: set[str] = set()
        self._digests_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._collector: ControlFeedCollector | None = None

    @property
    def subscriber(self) -> Subscriber:
        """The first shard's subscriber (the only one without control_plane.shards)."""
        return self._sub

    @property
    def subscribers(self) -> list[Subscriber]:
        """One per control-plane shard."""
        return list(self._subs)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start subscribing; returns at once (the control plane may be down)."""
        self._collector = ControlFeedCollector(self)
        with contextlib.suppress(ValueError):  # a second feed on one registry: no metrics
            self.metrics.registry.register(self._collector)
        for sub in self._subs:
            sub.start()
        self._tasks = [
            asyncio.ensure_future(self._refresh_loop()),
            asyncio.ensure_future(self._digest_loop()),
        ]
        log.info(
            "following the control plane at %s (stale after %.1f s)",
            "; ".join(", ".join(sub.targets) for sub in self._subs),
            self.stale_after_s,
        )

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        for sub in self._subs:
            await sub.close()
        if self._collector is not None:
            with contextlib.suppress(KeyError):
                self.metrics.registry.unregister(self._collector)
            self._collector = None

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, re-checked after every response applied and
        every connect or disconnect (updates reach the routers inside the response)."""
        if len(self._subs) == 1:
            await self._sub.wait_until(predicate)
            return
        waits = [asyncio.ensure_future(sub.wait_until(predicate)) for sub in self._subs]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(waits)

    # -- health ---------------------------------------------------------------------------

    def engines(self) -> dict[str, list[str]]:
        """Resource name -> the endpoint URLs it reports for."""
        return {n: [u for _, u, _ in t] for n, t in self._engines.items()}

    def health(self) -> dict[str, Any]:
        """For /readyz detail: a stale control plane does not make the sidecar unready
        (it routes on its own observations), but it is said here."""
        out = self._health(self._sub)
        out["engines"] = len(self._engines)
        if len(self._subs) > 1:
            # Worst of the shards at the top (stale if any shard is), each one below.
            shards = [self._health(sub) for sub in self._subs]
            out["connected"] = all(h["connected"] for h in shards)
            out["stale"] = any(h["stale"] for h in shards)
            out["unconfirmed_for_s"] = max(h["unconfirmed_for_s"] for h in shards)
            out["shards"] = shards
        return out

    def _health(self, sub: Subscriber) -> dict[str, Any]:
        age = sub.last_update_age_s
        stale_for = sub.stale_for_s
        return {
            "connected": sub.connected,
            "target": sub.target,
            "replicas": list(sub.targets),
            "stale": stale_for > self.stale_after_s,
            "unconfirmed_for_s": round(stale_for, 3),
            "last_update_age_s": None if age is None else round(age, 3),
            "transport": sub.transport,
            "connects": sub.stats.connects,
            "disconnects": sub.stats.disconnects,
            "failovers": sub.stats.failovers,
            "nacks": sub.stats.nacks,
            "last_nack": sub.stats.last_nack or None,
        }

    # -- updates --------------------------------------------------------------------------

    def _on_update(self, update: Update) -> None:
        now = self._clock()
        if update.type_url == ENDPOINT_STATE_TYPE:
            self._on_reports(update.changed, now)
            for name in update.removed:
                self._on_state(name, None, now)
        elif update.type_url == PREFIX_DIGEST_TYPE:
            for name, entry in update.changed.items():
                if isinstance(entry.value, PrefixDigest):
                    self._on_digest(name, entry.value, now)
            for name in update.removed:
                self._on_digest(name, None, now)

    def _shard_handler(self, shard: int) -> Callable[[Update], None]:
        def on_update(update: Update) -> None:
            self._on_shard_update(shard, update)

        return on_update

    def _on_shard_update(self, shard: int, update: Update) -> None:
        """An update from one of several shards: an engine is removed only once no shard
        holds it (the merge); everything else applies as from a single control plane."""
        if update.type_url == ENDPOINT_STATE_TYPE:
            holders = self._holders
            for name in update.changed:
                holders.setdefault(name, set()).add(shard)
            gone = []
            for name in update.removed:
                held = holders.get(name)
                if held is not None:
                    held.discard(shard)
                    if held:
                        continue  # another shard still has it
                    del holders[name]
                gone.append(name)
            if len(gone) != len(update.removed):
                update = Update(update.type_url, update.changed, frozenset(gone))
        self._on_update(update)

    def _on_reports(self, changed: Mapping[str, Entry], now: float) -> None:
        """The common case in a loop of its own (land_reports): an engine already ours, at
        the same address, in the same epoch; its state goes to its endpoints' routers.
        Anything else (new, moved, restarted, not ours) goes through _on_state."""
        applied = _land_reports(
            changed,
            self._engines,
            self._reports,
            self._by_address,
            now,
            self.stale_after_s,
            self._on_state,
        )
        if applied:
            self.stats.updates[ENDPOINT_STATE_TYPE] += applied

    def _targets_at(self, address: str) -> tuple[Target, ...]:
        """The endpoints at a published address (none: not ours), remembered."""
        targets = self._by_address.get(address)
        if targets is None:
            if len(self._by_address) >= MAX_ADDRESSES:
                self._by_address.clear()
            targets = self._targets.get(_address_key(address), ())
            self._by_address[address] = targets
        return targets

    def _on_state(self, name: str, report: EngineReport | None, now: float) -> None:
        old = self._engines.get(name, ())
        new = () if report is None else self._targets_at(report.address)
        if report is None:
            self.stats.removals[ENDPOINT_STATE_TYPE] += 1
        elif not new:
            self.stats.unmatched += 1
        for pool, url, _ in old:
            if not any(t[0] == pool and t[1] == url for t in new):  # moved, or gone
                self.routers[pool].report(url, None, now, ttl_s=self.stale_after_s)
                self.routers[pool].apply_digest(url, None, now)
        if not new:
            self._engines.pop(name, None)
            self._reports.pop(name, None)
            self._want_digest(name, False)
            return
        self._engines[name] = new
        assert report is not None
        before = self._reports.get(name)
        reported = self._reports[name] = report.state
        # From a known epoch to another (an unset one, "" or 0, says nothing).
        restarted = (
            before is not None and before.epoch not in ("", 0) and before.epoch != reported.epoch
        )
        for pool, url, tell in new:
            tell(url, reported, now, ttl_s=self.stale_after_s)
            if restarted and self._on_restart is not None:
                self._on_restart(pool, url, now)
        self.stats.updates[ENDPOINT_STATE_TYPE] += 1
        self._want_digest(name, True)

    def _on_digest(self, name: str, digest: PrefixDigest | None, now: float) -> None:
        targets = self._engines.get(name)
        if not targets:
            return
        if digest is None:
            self.stats.removals[PREFIX_DIGEST_TYPE] += 1
        for pool, url, _ in targets:
            if not self.routers[pool].apply_digest(url, digest, now) and digest is not None:
                self.stats.digests_ignored += 1
        if digest is not None:
            self.stats.updates[PREFIX_DIGEST_TYPE] += 1

    def _want_digest(self, name: str, wanted: bool) -> None:
        if wanted == (name in self._digest_names):
            return
        if wanted:
            self._digest_names.add(name)
        else:
            self._digest_names.discard(name)
        self._pending_digests.add(name)
        self._digests_wanted.set()

    async def _digest_loop(self) -> None:
        """(Un)subscribe PrefixDigests as engines become ours or stop being ours (the
        update callback is synchronous; the requests go out from here)."""
        while True:
            await self._digests_wanted.wait()
            self._digests_wanted.clear()
            pending, self._pending_digests = self._pending_digests, set()
            add = sorted(n for n in pending if n in self._digest_names)
            drop = sorted(n for n in pending if n not in self._digest_names)
            for sub in self._subs:  # an engine's digest is in its state's shard
                if add:
                    await sub.subscribe(PREFIX_DIGEST_TYPE, add)
                if drop:
                    await sub.unsubscribe(PREFIX_DIGEST_TYPE, drop)

    async def _refresh_loop(self) -> None:
        """While connected, the control plane vouches for the state we hold: renew it."""
        while True:
            await asyncio.sleep(self.refresh_s)
            live = {k for k, sub in enumerate(self._subs) if sub.connected}
            if live:
                self.refresh(self._clock(), live)

    def refresh(self, now: float, live: set[int]) -> None:
        """Renew the reports of the engines held by a connected shard (`live`: their
        indices). Each goes to its routers as the report they hold: a router renews its
        freshness alone (the picker's views of the endpoints stay valid)."""
        sharded = len(self._subs) > 1
        ttl_s = self.stale_after_s
        engines, holders = self._engines, self._holders
        for name, reported in self._reports.items():
            if sharded and not holders.get(name, set()) & live:
                continue  # its shard is away: its state is going stale
            for _, url, tell in engines.get(name, ()):
                tell(url, reported, now, ttl_s=ttl_s)
        self.stats.refreshes += 1


def land_reports(
    changed: Mapping[str, Entry],
    engines: dict[str, tuple[Target, ...]],
    reports: dict[str, ReportedState],
    by_address: dict[str, tuple[Target, ...]],
    now: float,
    ttl_s: float,
    on_state: Callable[[str, EngineReport, float], None],
) -> int:
    """A response's EngineReports to their endpoints' routers (ControlFeed._on_reports,
    with the feed's tables): an engine followed (`engines`: name -> its targets) whose
    report comes from the address it was matched at (`by_address`) in the epoch held
    (`reports`) has its state stored and told to each target's router; any other report
    goes to `on_state` (new, moved, restarted, not ours), a value not an EngineReport
    nowhere. Returns how many were told.

    The reference for the compiled twin (xds/_feed_c.pyx), which replaces it when built
    unless MESHD_PURE_PYTHON is set: with EndpointState.report compiled
    (filters/_endpoint_state_c.pyx), the routers' part of a sidecar's apply.
    """
    applied = 0
    for name, entry in changed.items():
        report = entry.value
        if type(report) is not EngineReport:
            continue
        targets = engines.get(name)
        state = report.state
        if (
            targets is None
            or by_address.get(report.address) is not targets
            or reports[name].epoch != state.epoch
        ):
            on_state(name, report, now)
            continue
        reports[name] = state
        for _, url, tell in targets:
            tell(url, state, now, ttl_s=ttl_s)
        applied += 1
    return applied


_land_reports = land_reports
LAND_IMPLEMENTATION = "python (forced by MESHD_PURE_PYTHON)"
PICKER_COMMON_IN_C = False  # PickerRouter.report's common path taken in the compiled loop
if not os.environ.get("MESHD_PURE_PYTHON"):
    try:
        from xds import _feed_c  # type: ignore[attr-defined]
    except ImportError:
        LAND_IMPLEMENTATION = "python (compiled extension not built)"
    else:
        _feed_c.bind(Entry, EngineReport, ReportedState)
        # PickerRouter.report's common path (a fresh report with the same TTL and KV
        # size for a known url) taken in the loop, the method kept as the reference.
        PICKER_COMMON_IN_C = _feed_c.bind_picker(
            PickerRouter, PickerRouter.__dict__["report"], EndpointState
        )
        _land_reports = _feed_c.land_reports
        LAND_IMPLEMENTATION = "cython"


def _family(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    doc: str,
    labels: Iterable[str],
    rows: Iterable[tuple[list[str], float]],
) -> CounterMetricFamily | GaugeMetricFamily:
    family = kind(name, doc, labels=list(labels))
    for values, v in rows:
        family.add_metric(values, v)
    return family


class ControlFeedCollector(Collector):
    """The feed's health as Prometheus metrics, read on scrape:

    - meshd_control_plane_connected (gauge): 1 while a stream to a replica is open
    - meshd_control_plane_replica_info (gauge, label `target`): 1 for the replica in use
    - meshd_control_plane_unconfirmed_seconds (gauge): how long the state has gone
      unconfirmed (0 while connected)
    - meshd_control_plane_stale (gauge): 1 once that is over stale_after_s
    - meshd_control_plane_last_update_age_seconds (gauge; NaN before the first update)
    - meshd_control_plane_engines (gauge): engines reporting for this sidecar's endpoints
    - meshd_control_plane_connects_total, _disconnects_total, _failovers_total,
      _nacks_total (counters)
    - meshd_control_plane_updates_total (counter, label `type`: endpoint_state,
      prefix_digest): resources applied
    - meshd_control_plane_apply_cpu_seconds_total (counter): thread CPU spent applying
      the control plane's responses (read, decode, into the routers)
    - meshd_control_plane_read_cpu_seconds_total (counter): of which reading them (the
      parse, each resource decoded)
    """

    def __init__(self, feed: ControlFeed) -> None:
        self.feed = feed

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        # With shards: connected only if every shard is, the worst staleness, each shard's
        # replica in use, the counters summed.
        feed, subs = self.feed, self.feed.subscribers
        unconfirmed = max(sub.stale_for_s for sub in subs)
        ages = [a for a in (sub.last_update_age_s for sub in subs) if a is not None]
        yield GaugeMetricFamily(
            "meshd_control_plane_connected",
            "1 while a stream to a control-plane replica is open (to every shard's)",
            value=1.0 if all(sub.connected for sub in subs) else 0.0,
        )
        yield _family(
            GaugeMetricFamily,
            "meshd_control_plane_replica_info",
            "The control-plane replica in use (1) or tried next, one per shard",
            ["target"],
            [([sub.target], 1.0) for sub in subs],
        )
        yield GaugeMetricFamily(
            "meshd_control_plane_unconfirmed_seconds",
            "Seconds the engine state has gone unconfirmed by a control plane (0: connected)",
            value=unconfirmed,
        )
        yield GaugeMetricFamily(
            "meshd_control_plane_stale",
            "1 once the engine state is older than control_plane.stale_after_s",
            value=1.0 if unconfirmed > feed.stale_after_s else 0.0,
        )
        yield GaugeMetricFamily(
            "meshd_control_plane_last_update_age_seconds",
            "Seconds since the last response from the control plane",
            value=max(ages) if len(ages) == len(subs) else math.nan,
        )
        yield GaugeMetricFamily(
            "meshd_control_plane_engines",
            "Engines reporting for this sidecar's endpoints",
            value=len(feed.engines()),
        )
        for name, doc in (
            ("connects", "Streams opened to a control-plane replica"),
            ("disconnects", "Streams to a control-plane replica lost"),
            ("failovers", "Moves to another control-plane replica"),
            ("nacks", "Control-plane responses refused (malformed resources)"),
        ):
            value = sum(getattr(sub.stats, name) for sub in subs)
            yield CounterMetricFamily(f"meshd_control_plane_{name}", doc, value=value)
        yield CounterMetricFamily(
            "meshd_control_plane_apply_cpu_seconds",
            "Thread CPU seconds spent applying control-plane responses (read, decode, "
            "into the routers)",
            value=sum(sub.stats.apply_cpu_s for sub in subs),
        )
        yield CounterMetricFamily(
            "meshd_control_plane_read_cpu_seconds",
            "Of the apply's thread CPU seconds, those reading the responses (the parse, each "
            "resource decoded)",
            value=sum(sub.stats.read_cpu_s for sub in subs),
        )
        yield _family(
            CounterMetricFamily,
            "meshd_control_plane_updates",
            "Resources from the control plane applied to the routers, by type",
            ["type"],
            [
                (["endpoint_state"], feed.stats.updates[ENDPOINT_STATE_TYPE]),
                (["prefix_digest"], feed.stats.updates[PREFIX_DIGEST_TYPE]),
            ],
        )
