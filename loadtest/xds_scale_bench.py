"""The control channel at fleet scale, each figure about one part: E simulated engines per
shard publish EndpointState at `--rate` updates/s each, through 1 or 2 control-plane shards
(each its own process, EDS view on, holding a full PrefixDigest per engine), to N thin
subscribers; per scenario, in one run.

Processes, so that each figure is one process's:

- control planes (xds/server.py's ControlPlane, `--push-interval`), one per shard: their
  CPU from /proc over the window, per update ingested, and RSS (with the engines' states
  only, with their digests too, and at the end of the window, current and peak; the peak
  is the digests' arrival, all at once as after a restart);
- publishers (xds.client.Publisher, or with `--transport frames` xds.publish_frames's
  FramePublisher on the control plane's frames port, as agents publish by default),
  `--publishers` processes (auto: enough that none is the bottleneck). An engine's
  shard is `meshd.shards.shard_for(name, shards)`; a shard's engines are grouped into
  nodes of `--per-message` engines (default 8: a node of 8 GPUs whose agent, `meshd
  agent --engines`, sends their updates in one publish message; with its engines over 2
  shards such a node sends ~4 to each, which is `--per-message 4`), each node publishing
  every 1/rate s on a stream of its own (`--streams` caps them).
  Bodies are encoded before the window and only their
  timestamp is spliced in, so what an agent spends encoding is not asked of the bench's
  CPU. The achieved rate is measured against the asked one: a scenario whose publishers
  fall short by more than 5% is INVALID, its figures no result;
- thin subscribers, `--per-process` to a process: a delta (or SotW) ADS stream to every
  shard, each response decoded (the protobuf parse) and ACKed, nothing applied (what a
  sidecar pays to apply them is loadtest/xds_apply_bench.py). A `--latency-share` of them
  (default 1 in 5) also time every update they get (the publish stamps found by one regex
  over the response); the rest count. With 2 shards a subscriber follows both and merges.
  Even thin, a grpc.aio subscriber costs ~125 us a response and ~0.6 us an update it
  receives (measured on the dev box, mostly grpc's read of the message), so 100 of them
  following 10,000 updates/s take ~0.8 of the 2 cores the control plane competes for.
  With `--subscriber-transport frames` the delta subscribers follow over the control
  plane's frames port instead (xds/publish_frames.py, as sidecars do by default; SotW
  stays on gRPC), the same messages, parsed and ACKed the same way.

Figures per scenario: update-to-subscriber latency p50/p99/max (the publish call started
-> a subscriber received it; the time travels in `tokens_in_flight`, microseconds of
CLOCK_MONOTONIC, which is system wide, a figure the EDS view leaves out), the share of
updates a timing subscriber saw (one that lags gets the latest of each engine:
coalesced), bytes/s and responses/s per subscriber; per shard: updates and messages/s
ingested, CPU share, CPU per update, RSS; the publishers' and subscribers' own CPU, and
the machine's busy cores (anything else running on it shows there).

Scenarios: delta x1 (1 shard, one subscriber: the baseline, whose control-plane CPU is the
ingest cost), SotW x1 (state of the world: every response carries every engine), delta xN
(1 shard: the fan-out), and for each further shard count S in `--shards`: delta xN with S
shards of E engines each (S times the fleet and the updates, so each shard carries what
the one did; "delta x1 Ssh" when N is 1). From the scenarios, unit costs: control-plane
CPU per ingested update (delta x1), per push and per update delivered per subscriber
((delta xN - delta x1) / what the N subscribers received), bytes per update delivered.

Targets checked (issue #23, a 2-core machine): at 1,000 engines x 10/s x 100 subscribers,
p99 < 100 ms, control plane <= 1 core, publishers >= 95% of the asked rate; control plane
<= 50 us CPU per ingested update (delta x1); RSS <= 300 MB with digests (at the end of the
window; the peak is printed beside it); two shards ingest twice the updates at the
per-update cost of one (within 20%).

--json PATH writes every figure: {"settings": {engines (per shard), rate, duration_s,
per_message, transport, subscriber_transport, publishers, streams, per_process,
latency_share, push_interval_s,
digest_blocks, subscribers, shards, cpus}, "scenarios": [{name, mode, subscribers, shards,
engines, valid, asked_per_s, published_per_s, publish_share, window_s, p50_ms, p99_ms,
max_ms, seen_share, bytes_per_s, responses_per_s, updates_per_response, cp_cpu_share,
cp_us_per_update, cp_rss_mib, cp_peak_rss_mib, cp_states_rss_mib, "per_shard":
[{updates_per_s, messages_per_s, updates_per_message, cpu_share, us_per_update, rss_mib,
peak_rss_mib, states_rss_mib, digests_rss_mib, responses, acks}], publishers,
pub_cpu_share, pub_max_process_share, pub_us_per_update, sub_cpu_share, sub_us_per_update,
bench_cpu_share, machine_busy_share, machine_steal_share}], "unit_costs": {per_message,
ingest_us_per_update, fanout_us_per_push_per_subscriber,
fanout_us_per_update_per_subscriber, bytes_per_update_delivered,
bytes_per_s_per_subscriber, sotw_over_delta_bytes, digest_rss_bytes_per_block},
"checks": [{name, verdict (PASS, FAIL or INVALID), detail}]}.

Run: .venv/bin/python -m loadtest.xds_scale_bench [--quick] [--engines 1000] [--rate 10]
     [--subscribers 100] [--shards 1,2] [--per-message 8] [--transport grpc|frames]
     [--subscriber-transport grpc|frames]
     [--push-interval 0.05]
     [--duration 15] [--digest-blocks 40000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import re
import statistics
import sys
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from loadtest import procstats

T = "type.googleapis.com/meshd.v1.EndpointState"
DIGEST_T = "type.googleapis.com/meshd.v1.PrefixDigest"
ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"
SOTW_METHOD = ADS + "StreamAggregatedResources"
DELTA_METHOD = ADS + "DeltaAggregatedResources"

# The targets (#23), on a 2-core machine.
TARGET_P99_MS = 100.0
TARGET_CP_CORES = 1.0
TARGET_PUBLISH_SHARE = 0.95  # below it a scenario is INVALID
TARGET_INGEST_US = 50.0
TARGET_RSS_MB = 300.0
TARGET_SHARD_COST_RATIO = 1.2
# An engine's body carries its publish time here, as msgpack uint64 (0xcf + 8 bytes).
_STAMP_KEY = b"\xb0tokens_in_flight\xcf"
_STAMP = re.compile(re.escape(_STAMP_KEY) + b"(.{8})", re.DOTALL)
_PLACEHOLDER_US = 1 << 40  # encodes as uint64, so a real stamp fits its 8 bytes
_VARIANTS = 4  # bodies per engine, cycled, so its other fields change too
_LATENCY_UNIT_US = 10  # the subscribers' latency histogram's bucket


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    mode: str  # "delta" or "sotw"
    subscribers: int
    shards: int = 1


# -- the engines' updates -----------------------------------------------------------------


def published_us(t: float) -> int:
    """A CLOCK_MONOTONIC reading in whole microseconds (an int field carries it)."""
    return round(t * 1e6)


def engine_name(i: int) -> str:
    return f"engine-{i:05d}"


def engine_body_us(i: int, seq: int, stamp_us: int) -> bytes:
    """Engine i's EndpointState, its `seq`th version, `tokens_in_flight` = `stamp_us`."""
    from xds.resources import EndpointState

    rng = random.Random(i * 1_000_003 + seq)
    return EndpointState(
        address=f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8000",
        pool=f"pool-{i % 10}",
        model="meta-llama/Llama-3.1-8B-Instruct",
        adapters={"sql-lora": True, "chat-lora": seq % 2 == 0},
        gpu="H100",
        gpu_count=8,
        memory_total_bytes=8 * 80 * 2**30,
        memory_used_bytes=8 * 61 * 2**30 + rng.randrange(2**30),
        kv_block_size=16,
        kv_capacity_blocks=40_000,
        kv_usage=round(rng.random(), 3),
        requests_running=rng.randrange(64),
        requests_waiting=rng.randrange(8),
        tokens_in_flight=stamp_us,  # the bench's clock
        ttft_s=round(rng.uniform(0.05, 0.5), 4),
        tpot_s=round(rng.uniform(0.01, 0.04), 4),
        epoch=f"{i:08x}",  # stable, as a running engine's
    ).encode()


def engine_body(i: int, seq: int, published_at: float) -> bytes:
    """Engine i's EndpointState published at `published_at` (CLOCK_MONOTONIC seconds)."""
    return engine_body_us(i, seq, published_us(published_at))


class StampedBodies:
    """An engine's bodies encoded once; `body(n, us)` is variant n % _VARIANTS with the
    publish time `us` spliced in (a publisher's cost per update stays a slice and a join)."""

    __slots__ = ("_parts",)

    def __init__(self, i: int) -> None:
        self._parts: list[tuple[bytes, bytes]] = []
        for seq in range(_VARIANTS):
            body = engine_body_us(i, seq, _PLACEHOLDER_US)
            at = body.index(_STAMP_KEY) + len(_STAMP_KEY)
            self._parts.append((body[:at], body[at + 8 :]))

    def body(self, n: int, us: int) -> bytes:
        head, tail = self._parts[n % _VARIANTS]
        return head + us.to_bytes(8, "big") + tail


def digest_body(i: int, blocks: int) -> bytes:
    """A full PrefixDigest of engine i holding `blocks` random block hashes: the bytes
    PrefixDigest.encode gives (tests/test_xds_scale_bench.py checks), made without a tuple
    of `blocks` ints (1,000 engines' digests of 40,000 blocks took seconds that way)."""
    import msgpack

    from xds.resources import SCHEMA_VERSION

    out: bytes = msgpack.packb(
        {
            "v": SCHEMA_VERSION,
            "engine": engine_name(i),
            "epoch": f"{i:08x}",
            "seq": 1,
            "base_seq": 1,
            "full": True,
            "block_size": 16,
            # little-endian uint64s, as array("Q").tobytes() on the machines we run on
            "added": random.Random(i).randbytes(8 * blocks),
            "removed": b"",
        }
    )
    return out


def plan_nodes(
    engines: int, shards: Sequence[tuple[str, ...]], per_message: int
) -> list[tuple[int, tuple[int, ...]]]:
    """(shard index, engine indices) per node: each shard's engines (by shard_for) in
    groups of `per_message`, so every publish message carries that many to one shard."""
    from meshd.shards import shard_for

    index = {s: k for k, s in enumerate(shards)}
    by_shard: list[list[int]] = [[] for _ in shards]
    for i in range(engines):
        by_shard[index[shard_for(engine_name(i), shards)]].append(i)
    return [
        (k, tuple(mine[j : j + per_message]))
        for k, mine in enumerate(by_shard)
        for j in range(0, len(mine), per_message)
    ]


# -- processes ----------------------------------------------------------------------------


def _control_plane(conn: Connection, push_interval_s: float, frames: bool = False) -> None:
    import xds  # noqa: F401
    from xds.server import ControlPlane, ServerLimits

    try:  # what `meshd control-plane` does first (xds/allocator.py; older trees: none)
        from xds.allocator import pin_mmap_threshold
    except ImportError:
        pass
    else:
        pin_mmap_threshold()

    async def main() -> None:
        # (ServerLimits() alone when 0, so the bench also runs against an older server.)
        limits = ServerLimits(push_interval_s=push_interval_s) if push_interval_s else None
        cp = ControlPlane(limits=limits)
        if frames:
            port = await cp.start("127.0.0.1", 0, publish_port=0)
            conn.send((port, cp.publish_port))
        else:  # (no publish_port: the bench also runs against an older server)
            conn.send((await cp.start("127.0.0.1", 0), 0))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        conn.send(
            {
                "responses": sum(cp.stats.responses.values()),
                "acks": sum(cp.stats.acks.values()),
                "publishes": cp.stats.publishes,
                "rejected": cp.stats.publishes_rejected,
            }
        )
        # The subscribers have gone: let their streams end rather than cancel them (grpc
        # prints a traceback for each handler a stop cancels).
        for _ in range(100):
            if not cp.stats.streams_open:
                break
            await asyncio.sleep(0.02)
        await cp.stop(0.5)

    asyncio.run(main())


def _publisher(
    conn: Connection,
    targets: list[str],
    nodes: list[tuple[int, tuple[int, ...]]],
    rate: float,
    streams: int,
    digest_blocks: int,
    frames_ports: Sequence[int] = (),
) -> None:
    """`frames_ports`: publish over each target's frames port (FramePublisher) instead."""
    from xds.client import Publisher
    from xds.publish_frames import FramePublisher

    def publisher(k: int) -> Publisher | FramePublisher:
        if frames_ports:
            return FramePublisher(targets[k].rpartition(":")[0], frames_ports[k])
        return Publisher(targets[k])

    names = {i: engine_name(i) for _, node in nodes for i in node}
    bodies = {i: StampedBodies(i) for i in names}

    async def main() -> None:
        # Per shard, a publish stream per node (each node's agent has its own link), or
        # up to `streams` of them with its nodes dealt over them.
        lanes: list[tuple[Publisher | FramePublisher, int, list[tuple[int, ...]]]] = []
        for k in range(len(targets)):
            mine = [node for shard, node in nodes if shard == k]
            n = min(streams or len(mine), len(mine))
            lanes.extend((publisher(k), k, mine[j::n]) for j in range(n))

        def message(node: tuple[int, ...], n: int, us: int) -> dict[str, bytes]:
            return {names[i]: bodies[i].body(n, us) for i in node}

        for pub, _, mine in lanes:  # every engine known before the clock starts
            for node in mine:
                await pub.publish(T, message(node, 0, published_us(time.monotonic())))
        conn.send("states")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        if digest_blocks:
            for pub, _, mine in lanes:
                for node in mine:
                    await pub.publish(
                        DIGEST_T, {names[i]: digest_body(i, digest_blocks) for i in node}
                    )
        conn.send("published")
        start, end = conn.recv()
        updates = [0] * len(targets)
        messages = [0] * len(targets)

        async def lane(
            pub: Publisher | FramePublisher, k: int, mine: list[tuple[int, ...]]
        ) -> None:
            period = 1.0 / (rate * len(mine))  # the lane's nodes, spread evenly
            t0 = time.monotonic() + random.random() * period
            n = 0
            while True:
                due = t0 + n * period
                now = time.monotonic()
                if due > now:
                    await asyncio.sleep(due - now)
                began = time.monotonic()
                if began >= end:
                    return
                node = mine[n % len(mine)]
                await pub.publish(T, message(node, n // len(mine) + 1, published_us(began)))
                if began >= start:
                    updates[k] += len(node)
                    messages[k] += 1
                n += 1

        await asyncio.gather(*(lane(*x) for x in lanes))
        for pub, _, _ in lanes:
            await pub.close()
        conn.send({"updates": updates, "messages": messages})

    asyncio.run(main())


class _Recorder:
    """What a process's thin subscribers receive: per subscriber the resources (to know
    when it is in sync), and inside the window the bytes, responses and updates; the
    latencies of updates published in the window, as one histogram of _LATENCY_UNIT_US."""

    def __init__(self, timed: list[bool]) -> None:
        n = len(timed)
        self.timed = timed
        self.start_us = self.end_us = 1 << 62
        self.start = self.end = float("inf")
        self.received = [0] * n
        self.bytes = [0] * n
        self.responses = [0] * n
        self.updates = [0] * n
        self.seen = [0] * n
        self.hist: Counter[int] = Counter()
        self.max_unit = 0

    def window(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.start_us, self.end_us = published_us(start), published_us(end)

    def response(self, k: int, raw: bytes, now: float, resources: int) -> list[bytes]:
        """Count one response of subscriber k; the stamps of its updates (raw) once the
        window opened, if k is one of those that time them."""
        self.received[k] += resources
        if now < self.start:
            return []
        if now < self.end:
            self.bytes[k] += len(raw)
            self.responses[k] += 1
            self.updates[k] += resources
        return _STAMP.findall(raw) if self.timed[k] else []

    def latencies(self, k: int, stamps: list[bytes], now: float) -> None:
        a = array("Q")
        a.frombytes(b"".join(stamps))
        if sys.byteorder == "little":
            a.byteswap()
        now_us, s, e = published_us(now), self.start_us, self.end_us
        units = [(now_us - x) // _LATENCY_UNIT_US for x in a if s <= x < e]
        if units:
            self.seen[k] += len(units)
            self.hist.update(units)
            self.max_unit = max(self.max_unit, max(units))


def _subscribers(
    conn: Connection,
    targets: list[str],
    timed: list[bool],
    mode: str,
    engines: int,
    frames_ports: Sequence[int] = (),
) -> None:
    """`frames_ports`: delta subscribers follow each target over its frames port."""
    from envoy.service.discovery.v3 import discovery_pb2 as pb
    from grpc import aio

    import xds  # noqa: F401
    from xds.publish_frames import SUBSCRIBE_PREAMBLE, frame

    n = len(timed)
    rec = _Recorder(timed)
    frames_at = dict(zip(targets, frames_ports, strict=False))

    async def delta_frames(k: int, target: str) -> None:
        reader, writer = await asyncio.open_connection(
            target.rpartition(":")[0], frames_at[target], limit=2**20
        )
        try:
            first = pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=["*"])
            first.node.id = f"thin-{os.getpid()}-{k}"
            writer.write(SUBSCRIBE_PREAMBLE + frame(first.SerializeToString()))
            if await reader.readexactly(len(SUBSCRIBE_PREAMBLE)) != SUBSCRIBE_PREAMBLE:
                raise RuntimeError(f"{target}: not answered on its frames port")
            while True:
                try:
                    head = await reader.readexactly(4)
                except asyncio.IncompleteReadError:
                    return
                raw = await reader.readexactly(int.from_bytes(head, "big"))
                now = time.monotonic()
                resp = pb.DeltaDiscoveryResponse.FromString(raw)
                stamps = rec.response(k, raw, now, len(resp.resources))
                if stamps:
                    rec.latencies(k, stamps, now)
                ack = pb.DeltaDiscoveryRequest(type_url=resp.type_url, response_nonce=resp.nonce)
                writer.write(frame(ack.SerializeToString()))
        finally:
            writer.close()

    async def delta(k: int, target: str) -> None:
        async with aio.insecure_channel(target) as ch:
            call = ch.stream_stream(
                DELTA_METHOD,
                request_serializer=pb.DeltaDiscoveryRequest.SerializeToString,
                response_deserializer=None,  # the raw bytes: counted, scanned, then parsed
            )()
            first = pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=["*"])
            first.node.id = f"thin-{os.getpid()}-{k}"
            await call.write(first)
            while True:
                raw = await call.read()
                if raw is aio.EOF:
                    return
                now = time.monotonic()
                resp = pb.DeltaDiscoveryResponse.FromString(raw)
                stamps = rec.response(k, raw, now, len(resp.resources))
                if stamps:
                    rec.latencies(k, stamps, now)
                await call.write(
                    pb.DeltaDiscoveryRequest(type_url=resp.type_url, response_nonce=resp.nonce)
                )

    async def sotw(k: int, target: str) -> None:
        held: Counter[bytes] = Counter()  # the stamps the previous response carried
        last = 0  # resources the previous response carried
        async with aio.insecure_channel(target) as ch:
            call = ch.stream_stream(
                SOTW_METHOD,
                request_serializer=pb.DiscoveryRequest.SerializeToString,
                response_deserializer=None,
            )()
            await call.write(pb.DiscoveryRequest(type_url=T))
            while True:
                raw = await call.read()
                if raw is aio.EOF:
                    return
                now = time.monotonic()
                resp = pb.DiscoveryResponse.FromString(raw)
                # Every response carries every engine: count only what changed.
                n_resources = len(resp.resources)
                rec.received[k] -= last
                last = n_resources
                stamps = rec.response(k, raw, now, n_resources)
                if stamps:
                    now_held = Counter(stamps)
                    new = now_held - held
                    held = now_held
                    rec.latencies(k, list(new.elements()), now)
                await call.write(
                    pb.DiscoveryRequest(
                        type_url=T, version_info=resp.version_info, response_nonce=resp.nonce
                    )
                )

    async def main() -> None:
        follow = sotw if mode != "delta" else delta_frames if frames_at else delta
        tasks = [asyncio.ensure_future(follow(k, t)) for k in range(n) for t in targets]
        while not all(r >= engines for r in rec.received):
            await asyncio.sleep(0.05)
            for t in tasks:
                if t.done():
                    t.result()  # a stream that failed: say why
        conn.send("synced")
        loop = asyncio.get_running_loop()
        rec.window(*await loop.run_in_executor(None, conn.recv))
        # Until the window closed and what was published in it had time to arrive.
        await loop.run_in_executor(None, conn.recv)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        conn.send(
            {
                "hist": dict(rec.hist),
                "max_unit": rec.max_unit,
                "bytes": rec.bytes,
                "responses": rec.responses,
                "updates": rec.updates,
                "seen": rec.seen,
                "timed": sum(timed),
            }
        )

    asyncio.run(main())


# -- one scenario -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardFigures:
    """One control-plane process over the window."""

    updates_per_s: float
    messages_per_s: float
    updates_per_message: float
    cpu_share: float
    us_per_update: float
    rss_mib: float
    peak_rss_mib: float
    states_rss_mib: float  # after every engine's state, before the digests
    digests_rss_mib: float  # after the digests too, before the window
    responses: int  # over its life (sync included)
    acks: int


@dataclass(frozen=True, slots=True)
class Result:
    scenario: Scenario
    engines: int  # over all shards
    asked_per_s: float
    published: int
    window_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    seen_share: float  # updates timed / (published x subscribers timing them)
    bytes_per_s: float  # per subscriber, mean
    responses_per_s: float  # per subscriber, mean
    updates_per_response: float
    per_shard: tuple[ShardFigures, ...]
    publishers: int
    pub_cpu_share: float
    pub_max_process_share: float  # the busiest publisher process (1.0: it was the limit)
    pub_us_per_update: float
    sub_cpu_share: float
    sub_us_per_update: float  # per update a subscriber received
    bench_cpu_share: float  # every process of the bench
    machine_busy_share: float  # the whole machine's busy cores (others' work included)
    machine_steal_share: float  # cores the hypervisor gave to someone else

    @property
    def published_per_s(self) -> float:
        return self.published / self.window_s

    @property
    def publish_share(self) -> float:
        return self.published_per_s / self.asked_per_s if self.asked_per_s else 0.0

    @property
    def valid(self) -> bool:
        return self.publish_share >= TARGET_PUBLISH_SHARE

    @property
    def cp_cpu_share(self) -> float:
        return sum(s.cpu_share for s in self.per_shard)

    @property
    def cp_us_per_update(self) -> float:
        return self.cp_cpu_share / max(1e-9, self.published_per_s) * 1e6

    @property
    def cp_rss_mib(self) -> float:
        return max(s.rss_mib for s in self.per_shard)

    @property
    def cp_peak_rss_mib(self) -> float:
        return max(s.peak_rss_mib for s in self.per_shard)

    @property
    def cp_states_rss_mib(self) -> float:
        return max(s.states_rss_mib for s in self.per_shard)

    def figures(self) -> dict[str, Any]:
        """Every figure, flat (the JSON's scenario entry)."""
        out: dict[str, Any] = {
            "name": self.scenario.name,
            "mode": self.scenario.mode,
            "subscribers": self.scenario.subscribers,
            "shards": self.scenario.shards,
            "valid": self.valid,
            "published_per_s": self.published_per_s,
            "publish_share": self.publish_share,
            "cp_cpu_share": self.cp_cpu_share,
            "cp_us_per_update": self.cp_us_per_update,
            "cp_rss_mib": self.cp_rss_mib,
            "cp_peak_rss_mib": self.cp_peak_rss_mib,
            "cp_states_rss_mib": self.cp_states_rss_mib,
        }
        for f in self.__dataclass_fields__:
            if f not in ("scenario", "per_shard", "published"):
                out[f] = getattr(self, f)
        out["per_shard"] = [asdict(s) for s in self.per_shard]
        return out


def _quantile(hist: Counter[int], q: float) -> float:
    """The q-quantile of a histogram of _LATENCY_UNIT_US buckets, in seconds."""
    total = sum(hist.values())
    if not total:
        return float("nan")
    rank = min(total - 1, int(q * total))
    seen = 0
    for unit in sorted(hist):
        seen += hist[unit]
        if seen > rank:
            return (unit + 0.5) * _LATENCY_UNIT_US / 1e6
    return float("nan")


def auto_publishers(updates_per_s: float, per_message: int) -> int:
    """Publisher processes for a rate: one per ~1,000 messages/s or 5,000 updates/s (a
    publisher process spends ~300 us of CPU on a message of 8 updates on the dev box), at
    least 2 above 1,000 updates/s, so that none is the bottleneck."""
    messages = updates_per_s / max(1, per_message)
    n = math.ceil(max(messages / 1000, updates_per_s / 5000))
    return max(1 if updates_per_s <= 1000 else 2, min(8, n))


def run_scenario(
    sc: Scenario,
    *,
    engines: int,
    rate: float,
    duration_s: float,
    per_message: int = 8,
    publishers: int = 0,
    streams: int = 0,
    per_process: int = 25,
    latency_share: float = 0.2,
    push_interval_s: float = 0.0,
    digest_blocks: int = 0,
    transport: str = "grpc",
    subscriber_transport: str = "grpc",
    tick: Callable[[float], None] = lambda s: None,
) -> Result:
    """One scenario: `engines` per shard (sc.shards of them), `rate` updates/s each;
    `transport`: what the publishers use, "grpc" or "frames"; `subscriber_transport`:
    what the delta subscribers follow over (SotW ones: gRPC)."""
    ctx = mp.get_context("spawn")
    procs: list[Any] = []

    def spawn(target: Callable[..., None], *args: Any) -> Connection:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        procs.append(p)
        return parent

    total = engines * sc.shards
    asked = total * rate
    n_pub = publishers or auto_publishers(asked, per_message)
    try:
        frames = transport == "frames"
        sub_frames = subscriber_transport == "frames" and sc.mode == "delta"
        cps = [
            spawn(_control_plane, push_interval_s, frames or sub_frames) for _ in range(sc.shards)
        ]
        ports = [c.recv() for c in cps]
        targets = [f"127.0.0.1:{port}" for port, _ in ports]
        frames_ports = [p for _, p in ports] if frames else []
        sub_ports = [p for _, p in ports] if sub_frames else []
        cp_pids = [p.pid for p in procs]
        nodes = plan_nodes(total, [(t,) for t in targets], per_message)
        random.Random(0).shuffle(nodes)
        n_pub = min(n_pub, len(nodes))
        pubs = [
            spawn(_publisher, targets, nodes[j::n_pub], rate, streams, digest_blocks, frames_ports)
            for j in range(n_pub)
        ]
        pub_pids = [p.pid for p in procs[len(cps) :]]
        for pub in pubs:
            assert pub.recv() == "states"
        states = [procstats.sample(pid) for pid in cp_pids]
        for pub in pubs:
            pub.send("digests")
        for pub in pubs:
            assert pub.recv() == "published"
        digests = [procstats.sample(pid) for pid in cp_pids]
        # Every `every`th subscriber times each update it gets (the rest count them).
        every = max(1, round(1 / latency_share)) if latency_share > 0 else sc.subscribers + 1
        timed = [k % every == 0 for k in range(sc.subscribers)]
        subs = [
            spawn(_subscribers, targets, timed[k : k + per_process], sc.mode, total, sub_ports)
            for k in range(0, sc.subscribers, per_process)
        ]
        sub_pids = [p.pid for p in procs[len(cps) + len(pubs) :]]
        for s in subs:
            assert s.recv() == "synced"
        start = time.monotonic() + 0.5
        end = start + duration_s
        for c in (*pubs, *subs):
            c.send((start, end))
        while time.monotonic() < start:
            time.sleep(0.01)
        everyone = [*cp_pids, *pub_pids, *sub_pids]
        before = [procstats.sample(pid) for pid in everyone]
        machine_before = procstats.machine_cpu()
        t = start
        while t < end:
            time.sleep(min(1.0, end - t))
            tick(min(1.0, end - t))
            t = time.monotonic()
        after = [procstats.sample(pid) for pid in everyone]
        machine_after = procstats.machine_cpu()
        sent = [pub.recv() for pub in pubs]
        time.sleep(min(2.0, 0.25 + duration_s * 0.05))  # the window's last updates land
        got = []
        for s in subs:
            s.send("stop")
            got.append(s.recv())
        cp_stats = []
        for c in cps:
            c.send("stop")
            cp_stats.append(c.recv())
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if any(c["rejected"] for c in cp_stats):
        raise RuntimeError(f"a control plane refused publishes: {cp_stats}")
    window = end - start
    cpu = [a.cpu_since(b) / window for a, b in zip(after, before, strict=True)]
    cp_cpu, pub_cpu = cpu[: len(cps)], cpu[len(cps) : len(cps) + len(pubs)]
    sub_cpu = cpu[len(cps) + len(pubs) :]
    updates = [sum(s["updates"][k] for s in sent) for k in range(len(cps))]
    messages = [sum(s["messages"][k] for s in sent) for k in range(len(cps))]
    published = sum(updates)
    hist: Counter[int] = Counter()
    for g in got:
        hist.update({int(k): v for k, v in g["hist"].items()})
    bytes_ = [b for g in got for b in g["bytes"]]
    responses = [r for g in got for r in g["responses"]]
    received = sum(u for g in got for u in g["updates"])
    seen = sum(s for g in got for s in g["seen"])
    timers = sum(g["timed"] for g in got)
    max_unit = max((g["max_unit"] for g in got), default=0)
    per_shard = tuple(
        ShardFigures(
            updates_per_s=updates[k] / window,
            messages_per_s=messages[k] / window,
            updates_per_message=updates[k] / max(1, messages[k]),
            cpu_share=cp_cpu[k],
            us_per_update=cp_cpu[k] * window / max(1, updates[k]) * 1e6,
            rss_mib=after[k].rss / 2**20,
            peak_rss_mib=after[k].peak_rss / 2**20,
            states_rss_mib=states[k].rss / 2**20,
            digests_rss_mib=digests[k].rss / 2**20,
            responses=cp_stats[k]["responses"],
            acks=cp_stats[k]["acks"],
        )
        for k in range(len(cps))
    )
    busy = steal = float("nan")
    if machine_before is not None and machine_after is not None:
        busy = (machine_after[0] - machine_before[0]) / window
        steal = (machine_after[1] - machine_before[1]) / window
    return Result(
        scenario=sc,
        engines=total,
        asked_per_s=asked,
        published=published,
        window_s=window,
        p50_ms=_quantile(hist, 0.5) * 1e3,
        p99_ms=_quantile(hist, 0.99) * 1e3,
        max_ms=(max_unit + 1) * _LATENCY_UNIT_US / 1e3 if hist else float("nan"),
        seen_share=seen / max(1, published * timers),
        bytes_per_s=statistics.fmean(bytes_) / window if bytes_ else 0.0,
        responses_per_s=statistics.fmean(responses) / window if responses else 0.0,
        updates_per_response=received / max(1, sum(responses)),
        per_shard=per_shard,
        publishers=len(pubs),
        pub_cpu_share=sum(pub_cpu),
        pub_max_process_share=max(pub_cpu, default=0.0),
        pub_us_per_update=sum(pub_cpu) * window / max(1, published) * 1e6,
        sub_cpu_share=sum(sub_cpu),
        sub_us_per_update=sum(sub_cpu) * window / max(1, received) * 1e6,
        bench_cpu_share=sum(cpu),
        machine_busy_share=busy,
        machine_steal_share=steal,
    )


# -- unit costs and targets ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """One of the issue's targets and whether this run met it."""

    name: str
    verdict: str  # PASS, FAIL or INVALID (a scenario it needs had short publishers)
    detail: str


def _find(results: Sequence[Result], mode: str, subscribers: int, shards: int) -> Result | None:
    for r in results:
        sc = r.scenario
        if (sc.mode, sc.subscribers, sc.shards) == (mode, subscribers, shards):
            return r
    return None


def _fanout(results: Sequence[Result]) -> Result | None:
    """The 1-shard delta scenario with the most subscribers (more than one)."""
    many = [r for r in results if r.scenario.mode == "delta" and r.scenario.shards == 1]
    many = [r for r in many if r.scenario.subscribers > 1]
    return max(many, key=lambda r: r.scenario.subscribers, default=None)


def unit_costs(
    results: Sequence[Result], *, per_message: int, digest_blocks: int
) -> dict[str, Any]:
    """The figures an operator sizes a fleet with (NaN where this run lacks a scenario)."""
    nan = float("nan")
    base = _find(results, "delta", 1, 1)
    sotw = _find(results, "sotw", 1, 1)
    fan = _fanout(results)
    top = fan or base
    out: dict[str, Any] = {
        "per_message": per_message,
        "ingest_us_per_update": base.cp_us_per_update if base else nan,
        "fanout_us_per_push_per_subscriber": nan,
        "fanout_us_per_update_per_subscriber": nan,
        "bytes_per_update_delivered": nan,
        "bytes_per_s_per_subscriber": top.bytes_per_s if top else nan,
        "sotw_over_delta_bytes": (
            sotw.bytes_per_s / base.bytes_per_s if sotw and base and base.bytes_per_s else nan
        ),
        "digest_rss_bytes_per_block": nan,
    }
    if top is not None and top.responses_per_s:
        out["bytes_per_update_delivered"] = top.bytes_per_s / (
            top.responses_per_s * top.updates_per_response
        )
    if base is not None and fan is not None and fan.responses_per_s:
        extra = fan.cp_cpu_share - base.cp_cpu_share * fan.published_per_s / base.published_per_s
        n = fan.scenario.subscribers
        out["fanout_us_per_push_per_subscriber"] = extra / (fan.responses_per_s * n) * 1e6
        delivered = fan.responses_per_s * fan.updates_per_response * n
        out["fanout_us_per_update_per_subscriber"] = extra / delivered * 1e6
    if base is not None and digest_blocks:
        s = base.per_shard[0]
        grew = (s.digests_rss_mib - s.states_rss_mib) * 2**20
        out["digest_rss_bytes_per_block"] = grew / (base.engines * digest_blocks)
    return out


def checks(results: Sequence[Result], *, digest_blocks: int) -> list[Check]:
    out: list[Check] = []

    def add(name: str, r: Result | None, ok: Callable[[Result], bool], detail: str) -> None:
        if r is None:
            return
        if not r.valid:
            out.append(Check(name, "INVALID", f"[{r.scenario.name}] {_short(r)}"))
        else:
            out.append(Check(name, "PASS" if ok(r) else "FAIL", f"[{r.scenario.name}] {detail}"))

    fan = _fanout(results)
    if fan is not None:
        each = fan.asked_per_s / fan.engines
        at = f"{fan.engines:,} engines x {each:g}/s x {fan.scenario.subscribers}"
        add(
            f"{at}: p99 update-to-subscriber < {TARGET_P99_MS:g} ms",
            fan,
            lambda r: r.p99_ms < TARGET_P99_MS,
            f"p99 {fan.p99_ms:.1f} ms",
        )
        add(
            f"{at}: control plane <= {TARGET_CP_CORES:g} core",
            fan,
            lambda r: r.cp_cpu_share <= TARGET_CP_CORES,
            f"{fan.cp_cpu_share:.2f} cores",
        )
    bad = [r for r in results if not r.valid]
    shares = ", ".join(f"{r.scenario.name} {r.publish_share:.0%}" for r in results)
    out.append(
        Check(
            f"publishers reach >= {TARGET_PUBLISH_SHARE:.0%} of the asked rate",
            "FAIL" if bad else "PASS",
            shares,
        )
    )
    base = _find(results, "delta", 1, 1)
    if base is not None:
        add(
            f"control plane <= {TARGET_INGEST_US:g} us CPU per ingested update",
            base,
            lambda r: r.cp_us_per_update <= TARGET_INGEST_US,
            f"{base.cp_us_per_update:.1f} us at "
            f"{base.per_shard[0].updates_per_message:.1f} updates a message",
        )
    # The largest of the valid one-shard scenarios (the state is the same in each; the
    # subscribers' streams add to it).
    one_shard = [r for r in results if r.scenario.shards == 1]
    one_shard = [r for r in one_shard if r.valid] or one_shard
    if one_shard:
        top = max(one_shard, key=lambda r: r.cp_rss_mib)
        mb, peak = top.cp_rss_mib * 2**20 / 1e6, top.cp_peak_rss_mib * 2**20 / 1e6
        add(
            f"control-plane RSS <= {TARGET_RSS_MB:g} MB ({top.engines:,} engines, digests of "
            f"{digest_blocks:,} blocks)",
            top,
            lambda r: mb <= TARGET_RSS_MB,
            f"{mb:.0f} MB at the end of the window, peak {peak:.0f} MB",
        )
    for r in results:
        if r.scenario.shards < 2:
            continue
        one = _find(results, r.scenario.mode, r.scenario.subscribers, 1)
        if one is None:
            continue
        name = (
            f"{r.scenario.shards} shards ingest {r.scenario.shards}x the updates at the "
            f"per-update cost of one (within {TARGET_SHARD_COST_RATIO - 1:.0%})"
        )
        if not (r.valid and one.valid):
            why = "; ".join(f"[{x.scenario.name}] {_short(x)}" for x in (r, one) if not x.valid)
            out.append(Check(name, "INVALID", why))
            continue
        times = r.published_per_s / one.published_per_s
        cost = r.cp_us_per_update / one.cp_us_per_update
        ok = times >= r.scenario.shards * TARGET_PUBLISH_SHARE and cost <= TARGET_SHARD_COST_RATIO
        out.append(
            Check(
                name,
                "PASS" if ok else "FAIL",
                f"[{r.scenario.name} vs {one.scenario.name}] {times:.2f}x the updates, "
                f"{cost:.2f}x the CPU per update ({r.cp_us_per_update:.1f} vs "
                f"{one.cp_us_per_update:.1f} us)",
            )
        )
    return out


def _short(r: Result) -> str:
    return (
        f"INVALID: publishers reached {r.published_per_s:,.0f} of {r.asked_per_s:,.0f}/s "
        f"({r.publish_share:.0%})"
    )


# -- report -------------------------------------------------------------------------------


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:,.1f} {unit}"
        b /= 1024
    return f"{b:.1f}"


def report(
    results: list[Result],
    *,
    engines: int,
    rate: float,
    per_message: int = 8,
    push_interval_s: float = 0.0,
    digest_blocks: int = 0,
) -> str:
    lines = [
        f"{engines:,} engines a shard x {rate:g} updates/s each, {per_message} engines a "
        f"publish message, push interval {push_interval_s * 1e3:g} ms, digests of "
        f"{digest_blocks:,} blocks, cpus={os.cpu_count()}",
        f"{'scenario':<16}{'asked/s':>9}{'pub':>6}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}"
        f"{'seen':>6}{'bytes/s/sub':>13}{'resp/s':>8}{'CP us/upd':>10}{'CP cpu':>8}"
        f"{'CP RSS':>8}{'peak':>7}",
    ]
    for r in results:
        lines.append(
            f"{r.scenario.name:<16}{r.asked_per_s:>9,.0f}{r.publish_share:>6.0%}"
            f"{r.p50_ms:>8.1f}{r.p99_ms:>8.1f}{r.max_ms:>8.0f}{r.seen_share:>6.0%}"
            f"{_fmt_bytes(r.bytes_per_s):>13}{r.responses_per_s:>8.1f}"
            f"{r.cp_us_per_update:>10.1f}{r.cp_cpu_share:>8.0%}{r.cp_rss_mib:>6.0f}Mi"
            f"{r.cp_peak_rss_mib:>5.0f}Mi" + ("" if r.valid else "  INVALID (publishers short)")
        )
    lines.append("per shard: updates/s, updates a message, CPU, CPU per update, RSS (states only)")
    for r in results:
        for k, s in enumerate(r.per_shard):
            lines.append(
                f"  {r.scenario.name:<16}#{k} {s.updates_per_s:>8,.0f}/s"
                f" {s.updates_per_message:5.1f} {s.cpu_share:5.0%} {s.us_per_update:6.1f} us"
                f" {s.rss_mib:5.0f}Mi "
                f"({s.states_rss_mib:.0f}Mi)"
            )
    lines.append(
        "CPU elsewhere: publishers (processes, share, busiest, us/update), subscribers "
        "(share, us per update received), bench total, machine busy (steal)"
    )
    for r in results:
        lines.append(
            f"  {r.scenario.name:<16}pub {r.publishers} {r.pub_cpu_share:5.0%} "
            f"{r.pub_max_process_share:4.0%} {r.pub_us_per_update:5.1f} us   sub "
            f"{r.sub_cpu_share:5.0%} {r.sub_us_per_update:5.1f} us   bench "
            f"{r.bench_cpu_share:5.0%}   machine {r.machine_busy_share:5.0%} "
            f"({r.machine_steal_share:.0%})"
        )
    base = results[0]
    lines.append(f"ratios against {base.scenario.name}:")
    for r in results[1:]:
        lines.append(
            f"  {r.scenario.name:<16} p99 x{r.p99_ms / base.p99_ms:.2f}  "
            f"CP CPU/update x{r.cp_us_per_update / base.cp_us_per_update:.2f}  "
            f"bytes/s per subscriber x{r.bytes_per_s / max(1.0, base.bytes_per_s):.2f}"
        )
    sotw = next((r for r in results if r.scenario.mode == "sotw"), None)
    if sotw is not None and base.bytes_per_s:
        lines.append(
            f"delta sends {sotw.bytes_per_s / base.bytes_per_s:.1f}x fewer bytes than "
            "state-of-the-world per subscriber"
        )
    u = unit_costs(results, per_message=per_message, digest_blocks=digest_blocks)
    lines += [
        "unit costs:",
        f"  control plane, per ingested update ({per_message} a message)"
        f"      {u['ingest_us_per_update']:8.1f} us",
        f"  control plane, per push to one subscriber"
        f"                 {u['fanout_us_per_push_per_subscriber']:8.1f} us",
        f"  control plane, per update delivered to one subscriber"
        f"     {u['fanout_us_per_update_per_subscriber']:8.2f} us",
        f"  bytes per update delivered {u['bytes_per_update_delivered']:,.0f}; per "
        f"subscriber {_fmt_bytes(u['bytes_per_s_per_subscriber'])}/s",
        f"  control-plane RSS per digest block {u['digest_rss_bytes_per_block']:.1f} bytes",
    ]
    for c in checks(results, digest_blocks=digest_blocks):
        lines.append(f"{c.verdict:<7} {c.name}: {c.detail}")
    return "\n".join(lines)


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def document(results: Sequence[Result], settings: dict[str, Any]) -> dict[str, Any]:
    """The --json document (its keys are listed in the module's docstring); NaN as null."""
    kw = {"digest_blocks": settings.get("digest_blocks", 0)}
    doc = {
        "settings": settings,
        "scenarios": [r.figures() for r in results],
        "unit_costs": unit_costs(results, per_message=settings.get("per_message", 0), **kw),
        "checks": [asdict(c) for c in checks(results, **kw)],
    }
    return dict(_no_nan(doc))


def scenarios(subscribers: int, shards: Sequence[int], sotw: bool) -> list[Scenario]:
    out = [Scenario("delta x1", "delta", 1)]
    if sotw:
        out.append(Scenario("sotw x1", "sotw", 1))
    for s in shards:
        if subscribers == 1 and s == 1:
            continue
        suffix = f" {s}sh" if s > 1 else ""
        out.append(Scenario(f"delta x{subscribers}{suffix}", "delta", subscribers, s))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short windows, 10 subscribers (<90 s)")
    ap.add_argument("--engines", type=int, default=1000, help="engines a shard")
    ap.add_argument("--rate", type=float, default=10.0, help="updates per second per engine")
    ap.add_argument("--subscribers", type=int, default=100, help="N of the delta xN scenarios")
    ap.add_argument("--shards", default="1,2", help="control-plane shards of delta xN")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per scenario window")
    ap.add_argument("--per-message", type=int, default=8, help="engines a publish message")
    ap.add_argument(
        "--transport",
        choices=("grpc", "frames"),
        default="grpc",
        help="what the publishers use: the gRPC publish stream, or the frames port",
    )
    ap.add_argument(
        "--subscriber-transport",
        choices=("grpc", "frames"),
        default="grpc",
        help="what the delta subscribers follow over: gRPC, or the frames port (as sidecars)",
    )
    ap.add_argument("--publishers", type=int, default=0, help="publisher processes (0: auto)")
    ap.add_argument(
        "--streams",
        type=int,
        default=0,
        help="publish streams a publisher process and shard (0: one a node, as agents)",
    )
    ap.add_argument("--per-process", type=int, default=25, help="subscribers per process")
    ap.add_argument(
        "--latency-share",
        type=float,
        default=0.2,
        help="share of the subscribers that time every update they get (the rest count)",
    )
    ap.add_argument(
        "--push-interval",
        type=float,
        default=0.05,
        help="the control plane's push_interval_s (seconds; 0: every loop turn)",
    )
    ap.add_argument(
        "--digest-blocks",
        type=int,
        default=40_000,
        help="blocks of each engine's PrefixDigest (0: none; 40,000: a full KV cache)",
    )
    ap.add_argument("--no-sotw", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.subscribers = min(args.subscribers, 10)
        args.duration = min(args.duration, 5.0)
    shards = [int(s) for s in args.shards.split(",") if s.strip()]
    runs = scenarios(args.subscribers, shards, not args.no_sotw)

    from tqdm import tqdm

    bar = tqdm(
        total=round(args.duration * len(runs)),
        desc="measuring (s)",
        disable=args.no_progress or not sys.stderr.isatty(),
    )
    results = []
    with contextlib.closing(bar):
        for sc in runs:
            bar.set_postfix_str(sc.name)
            results.append(
                run_scenario(
                    sc,
                    engines=args.engines,
                    rate=args.rate,
                    duration_s=args.duration,
                    per_message=args.per_message,
                    publishers=args.publishers,
                    streams=args.streams,
                    per_process=args.per_process,
                    latency_share=args.latency_share,
                    push_interval_s=args.push_interval,
                    digest_blocks=args.digest_blocks,
                    transport=args.transport,
                    subscriber_transport=args.subscriber_transport,
                    tick=lambda s: bar.update(round(s)),
                )
            )
    print(
        report(
            results,
            engines=args.engines,
            rate=args.rate,
            per_message=args.per_message,
            push_interval_s=args.push_interval,
            digest_blocks=args.digest_blocks,
        )
    )
    verdicts = checks(results, digest_blocks=args.digest_blocks)
    if args.json:
        settings = {
            "engines": args.engines,
            "rate": args.rate,
            "duration_s": args.duration,
            "per_message": args.per_message,
            "transport": args.transport,
            "subscriber_transport": args.subscriber_transport,
            "publishers": args.publishers,
            "streams": args.streams,
            "per_process": args.per_process,
            "latency_share": args.latency_share,
            "push_interval_s": args.push_interval,
            "digest_blocks": args.digest_blocks,
            "subscribers": args.subscribers,
            "shards": shards,
            "cpus": os.cpu_count(),
        }
        Path(args.json).write_text(json.dumps(document(results, settings), indent=2))
        print(f"wrote {args.json}")
    return 1 if any(c.verdict != "PASS" for c in verdicts) else 0


if __name__ == "__main__":
    raise SystemExit(main())
