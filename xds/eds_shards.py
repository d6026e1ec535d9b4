"""The EDS view of a sharded fleet. With control-plane shards (meshd/shards.py) each shard
holds its own engines only, but an Envoy follows one management server (ADS is one
stream; its cluster's endpoints come from one config source), so through a shard it would
see that shard's engines alone. So each shard serves Envoy the whole fleet: its EdsView
keeps its own engines' assignments under SHARD_CLA_TYPE, every other shard's are followed
over delta ADS (a wildcard subscription to their SHARD_CLA_TYPE: per pool, what changes
when an engine's health or weight step does, not every engine update), and what Envoy gets
under the EDS type is their merge, pool by pool: the bytes an unsharded control plane would
serve for the same engines. An Envoy may so follow any shard (the chart's Service balances
over them all), and no Envoy config changes with the number of shards.

A shard that cannot be reached keeps its engines in the view for `stale_after_s` (as an
engine whose agent went quiet keeps its state for the resource TTL), then they leave; they
come back when it answers again. Following starts with the first Envoy (no cost before:
the EDS view waits for one) and stops once no Envoy has followed this shard for
`unfollow_after_s` (an Envoy reconnecting in between finds it still following); the next
Envoy starts it again. Envoy's first assignment waits until every other shard has answered
once, at most `sync_timeout_s` (not a view with a shard missing, which would put the whole
pool's load on the shards that answered first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from envoy.config.endpoint.v3 import endpoint_pb2

from xds.cache import Resource, SnapshotCache
from xds.client import Backoff, Entry, Subscriber, Update
from xds.eds import CLA_TYPE, METADATA_NAMESPACE, SHARD_CLA_TYPE, encode_groups
from xds.wire import len_field

__all__ = [
    "SHARD_CLA_TYPE",
    "ShardEndpoint",
    "ShardedEds",
    "merge_assignments",
    "split_assignment",
]

log = logging.getLogger("meshd.xds.eds_shards")

STALE_AFTER_S = 30.0  # meshd control-plane --resource-ttl-s's default
SYNC_TIMEOUT_S = 2.0
UNFOLLOW_AFTER_S = 60.0  # no Envoy this long: stop following the other shards
TICK_S = 0.1  # staleness and readiness are looked at this often


@dataclass(frozen=True, slots=True)
class ShardEndpoint:
    """One engine of a shard's assignment: its GPU (the locality's sub_zone), its name (the
    meshd metadata's `engine`) and its LbEndpoint framed as lb_endpoints."""

    gpu: str
    engine: str
    lb_endpoint: bytes


def split_assignment(body: bytes) -> tuple[ShardEndpoint, ...]:
    """A ClusterLoadAssignment's engines (protobuf's DecodeError when it is not one)."""
    cla = endpoint_pb2.ClusterLoadAssignment.FromString(body)
    out: list[ShardEndpoint] = []
    for locality in cla.endpoints:
        gpu = locality.locality.sub_zone
        for lb in locality.lb_endpoints:
            meta = lb.metadata.filter_metadata.get(METADATA_NAMESPACE)
            engine = meta.fields["engine"].string_value if meta and "engine" in meta.fields else ""
            if not engine:  # not one of meshd's: its address names it
                sa = lb.endpoint.address.socket_address
                engine = f"{sa.address}:{sa.port_value}"
            framed = len_field(2, lb.SerializeToString(deterministic=True))
            out.append(ShardEndpoint(gpu, engine, framed))
    return tuple(out)


def merge_assignments(pool: str, shards: Iterable[Sequence[ShardEndpoint]]) -> bytes:
    """The pool's ClusterLoadAssignment over every shard's engines, laid out as EdsView
    lays one out (a locality per GPU generation, in name order; engines by name). An engine
    in two shards (its agent moved while shards were added) is taken from the first."""
    seen: set[str] = set()
    by_gpu: dict[str, list[ShardEndpoint]] = {}
    for endpoints in shards:
        for e in endpoints:
            if e.engine not in seen:
                seen.add(e.engine)
                by_gpu.setdefault(e.gpu, []).append(e)
    groups = [(gpu, sorted(by_gpu[gpu], key=lambda e: e.engine)) for gpu in sorted(by_gpu)]
    return encode_groups(pool, groups)


class ShardedEds:
    """Serves, under the EDS type in `cache`, every shard's assignments merged: this one's
    (kept under SHARD_CLA_TYPE in the same cache by its EdsView) and those of `shards` (the
    other shards, each its replicas' addresses), followed once `start` is called.

    Deferred as EdsView is: changes mark pools dirty and call `on_change`; `flush()`
    (the control plane's, once per fan-out) writes the pools touched since.

    `followed()` says whether an Envoy follows the view now (the control plane's streams);
    with it, following stops after `unfollow_after_s` without one (None: it never stops).
    """

    def __init__(
        self,
        cache: SnapshotCache,
        shards: Sequence[Sequence[str]],
        *,
        stale_after_s: float = STALE_AFTER_S,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
        credentials: grpc.ChannelCredentials | None = None,
        node_id: str = f"meshd-shard@{socket.gethostname()}",
        backoff: Backoff | None = None,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        followed: Callable[[], bool] | None = None,
        unfollow_after_s: float = UNFOLLOW_AFTER_S,
    ) -> None:
        self.cache = cache
        # The other shards; may be changed until `start` (a test's shards bind port 0).
        self.shards = [tuple(replicas) for replicas in shards]
        self.stale_after_s = stale_after_s
        self.sync_timeout_s = sync_timeout_s
        self._credentials = credentials
        self._node_id = node_id
        self._backoff = backoff or Backoff(base_s=0.25, max_s=5.0)
        self._on_change = on_change
        self._clock = clock
        self._subs: list[Subscriber] = []
        # Each shard's engines in the view: until it has been unreachable stale_after_s
        # (the Subscriber keeps what it last heard).
        self._live: list[bool] = []
        self._dirty: set[str] = set()
        self._own: dict[str, tuple[Resource, tuple[ShardEndpoint, ...]]] = {}
        self._started_at: float | None = None
        self._ready = False
        self._followed = followed
        self.unfollow_after_s = unfollow_after_s
        self._alone_since: float | None = None  # since when no Envoy follows the view
        self.stops = 0  # times following stopped for want of an Envoy
        self._task: asyncio.Task[None] | None = None
        self._unwatch = cache.watch(self._on_cache)

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._started_at is not None

    def start(self) -> None:
        """Follow the other shards (from the first Envoy on; again: nothing)."""
        if self._started_at is not None:
            return
        self._started_at = self._clock()
        self._subs = [
            Subscriber(
                replicas,
                {SHARD_CLA_TYPE: None},
                node_id=self._node_id,
                decoders={SHARD_CLA_TYPE: split_assignment},
                credentials=self._credentials,
                backoff=self._backoff,
                on_update=self._updated(k),
                clock=self._clock,
            )
            for k, replicas in enumerate(self.shards)
        ]
        self._live = [True] * len(self._subs)
        for sub in self._subs:
            sub.start()
        self._task = asyncio.ensure_future(self._watch_loop())
        # This shard's pools, and (following again) those of the view it served last.
        self._dirty |= set(self.cache.resources(SHARD_CLA_TYPE))
        self._dirty |= set(self.cache.resources(CLA_TYPE))
        log.info(
            "EDS over %d shards: following %s",
            len(self._subs) + 1,
            "; ".join(",".join(sub.targets) for sub in self._subs),
        )

    async def unfollow_if_alone(self) -> bool:
        """Stop following the other shards once no Envoy has followed the view for
        `unfollow_after_s` (their channels closed, the view left as it was: nobody reads
        it); returns whether it stopped. The watch loop calls it after each tick."""
        if self._started_at is None or self._followed is None:
            return False
        now = self._clock()
        if self._followed():
            self._alone_since = None
            return False
        if self._alone_since is None:
            self._alone_since = now
        if now - self._alone_since < self.unfollow_after_s:
            return False
        subs, self._subs = self._subs, []
        self._started_at = self._alone_since = None
        self._ready = False
        self._live = []
        self.stops += 1
        log.info("no Envoy for %.0f s: no longer following the other shards", self.unfollow_after_s)
        for sub in subs:
            await sub.close()
        return True

    async def close(self) -> None:
        self._unwatch()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sub in self._subs:
            await sub.close()

    # -- state ----------------------------------------------------------------------------

    @property
    def subscribers(self) -> list[Subscriber]:
        return list(self._subs)

    def ready(self) -> bool:
        """Whether Envoy may have the merged view: it holds what every other shard
        answered first, or `sync_timeout_s` passed since following began."""
        return self._ready

    def _synced(self) -> bool:
        if self._started_at is None:
            return False
        return (
            all(sub.last_update_age_s is not None for sub in self._subs)
            or self._clock() - self._started_at >= self.sync_timeout_s
        )

    @property
    def dirty(self) -> bool:
        return bool(self._dirty)

    def health(self) -> list[dict[str, object]]:
        """Per other shard: the replica followed, connected, and whether its engines are in
        the view."""
        return [
            {
                "target": sub.target,
                "connected": sub.connected,
                "in_view": live,
                "unconfirmed_for_s": round(sub.stale_for_s, 3),
            }
            for sub, live in zip(self._subs, self._live, strict=True)
        ]

    # -- changes --------------------------------------------------------------------------

    def _on_cache(self, type_url: str, names: frozenset[str]) -> None:
        if type_url == SHARD_CLA_TYPE and self._started_at is not None:
            self._dirty |= names
            self._on_change()

    def _updated(self, k: int) -> Callable[[Update], None]:
        def on_update(update: Update) -> None:
            self._dirty |= update.changed.keys() | update.removed
            self._on_change()

        return on_update

    def tick(self) -> None:
        """Take shards in or out of the view as they go stale or answer again, and see
        whether the view became ready."""
        changed = not self._ready and self._synced()  # the next flush makes it ready
        for k, sub in enumerate(self._subs):
            live = not sub.is_stale(self.stale_after_s)
            if live != self._live[k]:
                self._live[k] = live
                self._dirty |= set(sub.entries(SHARD_CLA_TYPE))
                changed = True
                if live:
                    log.info("shard %s answers again: its engines are back in EDS", sub.target)
                else:
                    log.warning(
                        "shard %s unreachable for %.1f s: its engines leave EDS",
                        sub.target,
                        sub.stale_for_s,
                    )
        if changed or self._dirty:
            self._on_change()

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(min(TICK_S, self.stale_after_s / 4))
            self.tick()
            if await self.unfollow_if_alone():
                self._task = None  # this task; start() makes another
                return

    def flush(self) -> None:
        """Write the merged assignment of every pool touched since the last flush (a pool
        no shard has any more is removed)."""
        if self._started_at is None:
            return
        if not self._dirty:
            self._ready = self._ready or self._synced()
            return
        pools, self._dirty = self._dirty, set()
        mine = self.cache.resources(SHARD_CLA_TYPE)
        theirs = [
            sub.entries(SHARD_CLA_TYPE) if live else {}
            for sub, live in zip(self._subs, self._live, strict=True)
        ]
        upserts: dict[str, bytes] = {}
        removed: list[str] = []
        for pool in pools:
            parts: list[Sequence[ShardEndpoint]] = []
            own = mine.get(pool)
            if own is not None:
                parts.append(self._own_endpoints(pool, own))
            else:
                self._own.pop(pool, None)
            parts.extend(_values(table, pool) for table in theirs if pool in table)
            if parts:
                upserts[pool] = merge_assignments(pool, parts)
            else:
                removed.append(pool)
        self.cache.update(CLA_TYPE, upserts, removed)
        self._ready = self._ready or self._synced()

    def _own_endpoints(self, pool: str, r: Resource) -> tuple[ShardEndpoint, ...]:
        hit = self._own.get(pool)
        if hit is not None and hit[0] is r:
            return hit[1]
        endpoints = split_assignment(r.body)
        self._own[pool] = (r, endpoints)
        return endpoints


def _values(table: Mapping[str, Entry], pool: str) -> tuple[ShardEndpoint, ...]:
    value: tuple[ShardEndpoint, ...] = table[pool].value
    return value
