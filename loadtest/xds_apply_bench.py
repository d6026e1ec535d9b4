"""What it costs a sidecar to follow the control plane: applying EndpointState updates to
its pools' routers (issue #23's "sidecars that follow cheaply": <= 3 us an update, so
1,000 engines at 10 Hz take <= 3% of one core).

(a) apply, in-process: pre-encoded DeltaDiscoveryResponse messages (E engines, their
state changing every update) fed through the sidecar's own path: the protobuf parse gRPC
does, Subscriber._apply (decode, all-or-nothing, the ACK, serialized) and the
ControlFeed's apply into the routers (`PoolRouter.report`); CPU microseconds per update
(thread_time over the whole run, median of `--rounds`), for several resources per
response, the path before this bench's change (a copy, below) against the current one in
the same run.

(b) one real sidecar process (`meshd sidecar`, control_plane.addresses set, pools naming
the E engines) following a real control plane (xds/server.py's ControlPlane, its own
process, with its frames port) while publisher processes write `--rate` updates/s into it
through xds.client.Publisher, `--batch` engines a publish; the sidecar's CPU share from
/proc (loadtest/procstats.py) over the window, against the updates it applied (its
meshd_control_plane_updates_total), and its share idle (the same sidecar, nothing
published) just before. `--transports grpc,frames` runs it once per transport the sidecar
follows over (grpc: control_plane.frames off; frames: the default), `--process-rounds N`
times, alternated, each run a fresh set of processes.

Run: .venv/bin/python -m loadtest.xds_apply_bench [--engines 1000] [--updates 20000]
     [--per-response 1,10,100] [--rounds 5] [--rate 10000] [--duration 10] [--batch 50]
     [--ack-pace-ms MS] [--push-interval-ms MS] [--transports grpc,frames]
     [--process-rounds N] [--no-process] [--json PATH]

--json PATH writes every figure: `engines`; `apply` (per resources-per-response K, as a
string key): {"before_us", "now_us", "now_over_before", "before_cold_us", "now_cold_us",
"cold_now_over_before"} (cold: each response applied after COLD_GAP_S asleep, as a
sidecar's caches are when a push comes; thread CPU of the applies alone); `process` (absent with
--no-process): {"asked_per_s", "published_per_s", "applied_per_s", "window_s",
"sidecar_cpu_share", "sidecar_us_per_update", "sidecar_apply_us_per_update" (of that,
the sidecar's thread CPU applying responses: read, decode, into the routers; the rest is
gRPC's read and ACK, the event loop and the sidecar's idle work),
"sidecar_read_us_per_update" (of the apply, reading the responses: the parse, each
resource decoded; the rest is the routers' part), "sidecar_idle_share",
"sidecar_share_at_10hz" (the share the measured us/update gives 1,000 engines at 10 Hz),
"control_plane_cpu_share", "publishers_cpu_share", "engines_followed",
"updates_per_response" (what the control plane's pushes to the sidecar carried),
"ack_pace_ms" (the sidecar's ACK pace: control_plane.ack_pace_s, or --ack-pace-ms),
"push_interval_ms" (the control plane's push_interval_s: --push-interval-ms),
"transport" (what the sidecar followed over: grpc or frames)}, the median run (by
us/update) of the first transport in --transports; `process_runs`: {transport: [every
run's figures, as `process`]}.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import yaml
from envoy.service.discovery.v3 import discovery_pb2 as pb

import xds  # noqa: F401  (makes xds-protos' own `xds` package importable; see xds/__init__.py)
from loadtest import procstats
from loadtest.xds_scale_bench import engine_body_us, engine_name
from xds.client import Update
from xds.delta_response import Entry, _entry
from xds.resources import EndpointState, ResourceError, decode_endpoint_state

T = "type.googleapis.com/meshd.v1.EndpointState"
POOLS = 10  # engine i is in pool-{i % POOLS}, as loadtest/xds_scale_bench.py's engines
# (a)'s cold figure: responses applied after a sleep each (caches cold, as a sidecar's are
# when the next push comes), at most this many a round.
COLD_GAP_S = 0.002
COLD_RESPONSES = 300


# -- the engines and the sidecar's config ---------------------------------------------------


def engine_address(i: int) -> str:
    return f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8000"


def engine_body(i: int, seq: int) -> bytes:
    """Engine i's EndpointState at its update `seq`: xds_scale_bench's engine, with a
    tokens_in_flight that changes every update (that bench stamps its clock there)."""
    return engine_body_us(i, seq, (i * 7919 + seq * 104_729) % 500_000)


def sidecar_config(
    engines: int,
    control_plane: str = "127.0.0.1:1",
    *,
    named: bool = True,
    ack_pace_s: float | None = None,
    frames: bool = True,
) -> dict[str, Any]:
    """A sidecar routing to every engine, in POOLS pools (the `meshd` policy); `named`:
    each endpoint names its engine, so the sidecar subscribes by name (pool-scoped), else
    it takes the wildcard. `ack_pace_s`: control_plane.ack_pace_s (None: the default).
    `frames`: control_plane.frames (False: the sidecar follows over gRPC only)."""

    def endpoint(i: int) -> dict[str, str]:
        url = f"http://{engine_address(i)}"
        return {"url": url, "engine": engine_name(i)} if named else {"url": url}

    return {
        "listeners": {
            "outbound": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
        },
        "pools": [
            {
                "name": f"pool-{p}",
                "endpoints": [endpoint(i) for i in range(p, engines, POOLS)],
            }
            for p in range(min(POOLS, engines))
        ],
        "routing": {"policy": "meshd"},
        "control_plane": {
            "addresses": [control_plane],
            "frames": frames,
            **({} if ack_pace_s is None else {"ack_pace_s": ack_pace_s}),
        },
        "drain": {"grace_period_s": 0},
    }


# -- (a) apply, in-process --------------------------------------------------------------------


def responses(engines: int, updates: int, per_response: int) -> tuple[list[bytes], list[bytes]]:
    """(sync, run): the serialized responses that give the sidecar every engine once, then
    `updates` updates, `per_response` to a response, engines in turn."""
    seq = [0] * engines
    nonce = 0

    def build(indices: Sequence[int]) -> bytes:
        nonlocal nonce
        nonce += 1
        m = pb.DeltaDiscoveryResponse(type_url=T, nonce=str(nonce), system_version_info="1")
        for i in indices:
            seq[i] += 1
            r = m.resources.add(name=engine_name(i), version=f"{i:05d}-{seq[i]:012d}")
            r.resource.type_url = T
            r.resource.value = engine_body(i, seq[i])
        return m.SerializeToString()

    sync = [build(range(k, min(engines, k + 100))) for k in range(0, engines, 100)]
    order = [n % engines for n in range(updates)]
    run = [build(order[k : k + per_response]) for k in range(0, updates, per_response)]
    return sync, run


@dataclass(frozen=True, slots=True)
class ApplyPath:
    """One way of applying a serialized response: `apply` returns the serialized ACK;
    `followed` counts the engines followed; `routers` are the pools' routers it reports to."""

    apply: Callable[[bytes], bytes]
    followed: Callable[[], int]
    routers: Mapping[str, Any]


def feed_apply(engines: int) -> ApplyPath:
    """The sidecar's path for one serialized response as gRPC hands it over (bytes): the
    subscriber's parse and apply and the feed's, the ACK serialized."""
    from meshd.config import load_config
    from meshd.control_feed import ControlFeed
    from meshd.metrics import DataPlaneMetrics
    from meshd.pools import build_routers

    cfg = load_config(None, base=sidecar_config(engines), env={})
    feed = ControlFeed(cfg, build_routers(cfg), DataPlaneMetrics())
    return ApplyPath(feed.subscriber._apply, lambda: len(feed.engines()), feed.routers)


class _Before:
    """The path as it was before this bench (commit b8d2810): Subscriber._apply and
    ControlFeed._on_update/_on_state, copied with the state they keep, so the two are
    measured in the same run. Decodes each body to an EndpointState (one-pass decoder),
    converts it with to_reported, finds its endpoints through urlsplit, per update."""

    def __init__(self, engines: int) -> None:
        from meshd.config import load_config
        from meshd.pools import build_routers

        cfg = load_config(None, base=sidecar_config(engines), env={})
        self.routers = build_routers(cfg)
        self.stale_after_s = cfg.control_plane.stale_after_s
        self.decoder = decode_endpoint_state
        self.state: dict[str, Any] = {}
        self.updates: Counter[str] = Counter()
        self.removals: Counter[str] = Counter()
        self.unmatched = 0
        self.responses = self.acks = self.nacks = 0

        def host_port(url: str) -> str:
            parts = urlsplit(url)
            host = (parts.hostname or "").lower()
            if ":" in host:
                host = f"[{host}]"
            return f"{host}:{parts.port}"

        self.host_port = host_port
        self.targets: dict[str, list[tuple[str, str]]] = {}
        for pool in cfg.pools:
            for ep in pool.endpoints:
                self.targets.setdefault(host_port(ep.url), []).append((pool.name, ep.url))
        self.engines: dict[str, list[tuple[str, str]]] = {}
        self.reports: dict[str, Any] = {}
        self.digest_names: set[str] = set()
        self.pending_digests: set[str] = set()
        self.on_restart: Callable[[str, str, float], None] | None = None

    def address_key(self, address: str) -> str:
        if "://" not in address:
            address = "http://" + address
        try:
            return self.host_port(address)
        except ValueError:
            return address

    def apply(self, resp: Any) -> Any:
        now = time.monotonic()
        self.responses += 1
        t = resp.type_url
        reply = pb.DeltaDiscoveryRequest(type_url=t, response_nonce=resp.nonce)
        decoder = self.decoder
        changed: dict[str, Entry] = {}
        try:
            for r in resp.resources:
                name = r.name
                any_ = r.resource
                if any_.type_url != t:
                    raise ResourceError(f"Any type {any_.type_url!r} in a {t} response")
                try:
                    value = decoder(any_.value)
                except ResourceError as exc:
                    raise ResourceError(f"{name}: {exc}") from None
                changed[name] = _entry(name, r.version, value, now)
        except ResourceError as exc:
            self.nacks += 1
            reply.error_detail.code = 3
            reply.error_detail.message = str(exc)
            return reply
        table = self.state
        table.update(changed)
        removed = frozenset(n for n in resp.removed_resources if table.pop(n, None) is not None)
        self.acks += 1
        if changed or removed:
            self.on_update(Update(t, MappingProxyType(changed), removed))
        return reply

    def on_update(self, update: Any) -> None:
        now = time.monotonic()
        for name, entry in update.changed.items():
            if isinstance(entry.value, EndpointState):
                self.on_state(name, entry.value, now)
        for name in update.removed:
            self.on_state(name, None, now)

    def on_state(self, name: str, state: Any, now: float) -> None:
        old = self.engines.get(name, [])
        new = [] if state is None else self.targets.get(self.address_key(state.address), [])
        if state is None:
            self.removals[T] += 1
        elif not new:
            self.unmatched += 1
        for pool, url in old:
            if (pool, url) not in new:
                self.routers[pool].report(url, None, now, ttl_s=self.stale_after_s)
                self.routers[pool].apply_digest(url, None, now)
        if not new:
            self.engines.pop(name, None)
            self.reports.pop(name, None)
            self.want_digest(name, False)
            return
        self.engines[name] = new
        before = self.reports.get(name)
        reported = self.reports[name] = state.to_reported()
        restarted = (
            before is not None and before.epoch not in ("", 0) and before.epoch != reported.epoch
        )
        for pool, url in new:
            self.routers[pool].report(url, reported, now, ttl_s=self.stale_after_s)
            if restarted and self.on_restart is not None:
                self.on_restart(pool, url, now)
        self.updates[T] += 1
        self.want_digest(name, True)

    def want_digest(self, name: str, wanted: bool) -> None:
        if wanted == (name in self.digest_names):
            return
        if wanted:
            self.digest_names.add(name)
        else:
            self.digest_names.discard(name)
        self.pending_digests.add(name)


def before_apply(engines: int) -> ApplyPath:
    """feed_apply's twin for the path before (_Before)."""
    follower = _Before(engines)
    parse = pb.DeltaDiscoveryResponse.FromString

    def apply(raw: bytes) -> bytes:
        out: bytes = follower.apply(parse(raw)).SerializeToString()
        return out

    return ApplyPath(apply, lambda: len(follower.engines), follower.routers)


def bench_apply(
    engines: int, updates: int, per_response: int, rounds: int
) -> dict[str, list[float]]:
    """CPU µs per update of each path, one sample per round (the paths take turns)."""
    sync, run = responses(engines, updates, per_response)
    paths = {"before": before_apply(engines), "now": feed_apply(engines)}
    for name, path in paths.items():
        for raw in sync:
            path.apply(raw)
        if path.followed() != engines:
            raise RuntimeError(f"{name}: follows {path.followed()} engines of {engines}")
    samples: dict[str, list[float]] = {k: [] for k in (*paths, *(f"{k}_cold" for k in paths))}
    cold = run[:COLD_RESPONSES]
    cold_updates = min(updates, len(cold) * per_response)
    for _ in range(rounds):
        for name, path in paths.items():
            apply = path.apply
            gc.collect()
            t0 = time.thread_time()
            for raw in run:
                apply(raw)
            samples[name].append((time.thread_time() - t0) / updates * 1e6)
            # As a sidecar between pushes: asleep, its caches taken by whatever else runs.
            spent = 0.0
            for raw in cold:
                time.sleep(COLD_GAP_S)
                t0 = time.thread_time()
                apply(raw)
                spent += time.thread_time() - t0
            samples[f"{name}_cold"].append(spent / cold_updates * 1e6)
    return samples


# -- (b) one sidecar process ------------------------------------------------------------------


def _control_plane(conn: Connection, push_interval_s: float = 0.0) -> None:
    from xds.server import ControlPlane, ServerLimits

    async def main() -> None:
        cp = ControlPlane(limits=ServerLimits(push_interval_s=push_interval_s))
        # With its frames port, as `meshd control-plane` serves it (a sidecar follows there
        # unless control_plane.frames is off).
        port = await cp.start("127.0.0.1", 0, publish_port=0)
        conn.send(port)
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, conn.recv) == "responses":
            conn.send(cp.stats.responses[T])
        await cp.stop(0)

    asyncio.run(main())


def _publisher(
    conn: Connection, port: int, mine: list[int], rate: float, batch: int, variants: int
) -> None:
    """Publishes engines `mine` at `rate` updates/s in all, `batch` engines a publish,
    cycling through `variants` pre-encoded states per engine (so every update changes)."""
    from xds.client import Publisher

    bodies = {i: [engine_body(i, v) for v in range(variants)] for i in mine}

    async def main() -> None:
        pub = Publisher(f"127.0.0.1:{port}")
        for k in range(0, len(mine), batch):
            await pub.publish(T, {engine_name(i): bodies[i][0] for i in mine[k : k + batch]})
        conn.send("published")
        start, end = conn.recv()
        period = batch / rate
        n = sent = 0
        pos = 0
        while True:
            due = start + n * period
            now = time.monotonic()
            if due > now:
                await asyncio.sleep(due - now)
            if time.monotonic() >= end:
                break
            group = [mine[(pos + j) % len(mine)] for j in range(batch)]
            pos += batch
            v = 1 + (pos // len(mine)) % (variants - 1)
            await pub.publish(T, {engine_name(i): bodies[i][v] for i in group})
            sent += batch
            n += 1
        conn.send(sent)
        await pub.close()

    asyncio.run(main())


_UPDATES = re.compile(r'^meshd_control_plane_updates_total\{type="endpoint_state"\} (\S+)$', re.M)
_ENGINES = re.compile(r"^meshd_control_plane_engines (\S+)$", re.M)
_APPLY_CPU = re.compile(r"^meshd_control_plane_apply_cpu_seconds_total (\S+)$", re.M)
_READ_CPU = re.compile(r"^meshd_control_plane_read_cpu_seconds_total (\S+)$", re.M)


def _transport(admin: str) -> str:
    """What the sidecar follows the control plane over (its /readyz detail)."""
    try:
        with urllib.request.urlopen(f"http://{admin}/readyz?verbose", timeout=5) as r:
            body = r.read().decode()
    except urllib.error.HTTPError as exc:  # not ready yet: the detail is still there
        body = exc.read().decode()
    m = re.search(r'"transport":\s*"(\w+)"', body)
    return m.group(1) if m else ""


def _scrape(admin: str) -> tuple[float, float, float, float]:
    """(endpoint_state updates applied, engines followed, thread CPU seconds spent applying
    responses, of which reading them) from the sidecar's /metrics."""
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=5) as r:
        text = r.read().decode()
    found = [p.search(text) for p in (_UPDATES, _ENGINES, _APPLY_CPU, _READ_CPU)]
    u, e, a, rd = (float(m.group(1)) if m else 0.0 for m in found)
    return u, e, a, rd


def bench_process(
    engines: int,
    rate: float,
    duration_s: float,
    batch: int,
    publishers: int,
    named: bool = True,
    ack_pace_s: float | None = None,
    transport: str = "frames",
    push_interval_s: float = 0.0,
) -> dict[str, Any]:
    from loadtest.overhead import start_child

    ctx = mp.get_context("spawn")
    procs: list[Any] = []

    def spawn(target: Callable[..., None], *args: Any) -> Connection:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        procs.append(p)
        return parent

    sidecar = None
    with tempfile.TemporaryDirectory(prefix="xds-apply-") as tmp:
        try:
            cp = spawn(_control_plane, push_interval_s)
            port = cp.recv()
            cp_pid = procs[0].pid
            pubs = [
                spawn(
                    _publisher,
                    port,
                    list(range(k, engines, publishers)),
                    rate / publishers,
                    batch,
                    8,
                )
                for k in range(publishers)
            ]
            for p in pubs:
                if p.recv() != "published":
                    raise RuntimeError("a publisher did not start")
            path = Path(tmp) / "sidecar.yaml"
            config = sidecar_config(
                engines,
                f"127.0.0.1:{port}",
                named=named,
                ack_pace_s=ack_pace_s,
                frames=transport == "frames",
            )
            path.write_text(yaml.safe_dump(config))
            cmd = [sys.executable, "-m", "meshd.cli", "sidecar", "--config", str(path)]
            sidecar = start_child("sidecar", cmd, Path(tmp), 60.0)
            admin = str(sidecar.ready["admin"])
            deadline = time.monotonic() + 60
            while _scrape(admin)[1] < engines or _transport(admin) != transport:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the sidecar follows {_scrape(admin)[1]:.0f} engines over "
                        f"{_transport(admin)}; wanted {engines} over {transport}"
                    )
                time.sleep(0.1)
            pid = sidecar.proc.pid
            # Idle: the sidecar connected, nothing published.
            idle_s = min(3.0, duration_s)
            i0 = procstats.sample(pid)
            time.sleep(idle_s)
            i1 = procstats.sample(pid)
            start = time.monotonic() + 0.5
            end = start + duration_s
            for p in pubs:
                p.send((start, end))
            while time.monotonic() < start:
                time.sleep(0.01)
            u0, _, a0, rd0 = _scrape(admin)
            cp.send("responses")
            r0 = cp.recv()
            s0 = procstats.sample(pid)
            c0 = procstats.sample(cp_pid)
            p0 = [procstats.sample(p.pid) for p in procs[1:]]
            time.sleep(max(0.0, end - time.monotonic()))
            s1 = procstats.sample(pid)
            c1 = procstats.sample(cp_pid)
            p1 = [procstats.sample(p.pid) for p in procs[1:]]
            window = time.monotonic() - start
            u1, followed, a1, rd1 = _scrape(admin)
            cp.send("responses")
            r1 = cp.recv()
            published = sum(p.recv() for p in pubs)
            sidecar.stop()  # before the control plane, whose stop would cut its stream
            sidecar = None
            cp.send("stop")
        finally:
            if sidecar is not None:
                sidecar.stop()
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    applied = u1 - u0
    cpu = s1.cpu_since(s0)
    us = cpu / max(1.0, applied) * 1e6
    return {
        "transport": transport,
        "asked_per_s": rate,
        "published_per_s": published / duration_s,
        "applied_per_s": applied / window,
        "window_s": window,
        "sidecar_cpu_share": cpu / window,
        "sidecar_us_per_update": us,
        "sidecar_apply_us_per_update": (a1 - a0) / max(1.0, applied) * 1e6,
        "sidecar_read_us_per_update": (rd1 - rd0) / max(1.0, applied) * 1e6,
        "sidecar_idle_share": i1.cpu_since(i0) / idle_s,
        "sidecar_share_at_10hz": us * 1e-6 * 10_000,
        "control_plane_cpu_share": c1.cpu_since(c0) / window,
        "publishers_cpu_share": sum(b.cpu_since(a) for a, b in zip(p0, p1, strict=True)) / window,
        "engines_followed": followed,
        "updates_per_response": applied / max(1, r1 - r0),
    }


# -- report -------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--updates", type=int, default=20_000, help="updates per round of (a)")
    ap.add_argument("--per-response", default="1,10,100", help="resources per response, (a)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rate", type=float, default=10_000, help="updates/s published, (b)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of (b)'s window")
    ap.add_argument("--batch", type=int, default=50, help="engines a publish, (b)")
    ap.add_argument("--publishers", type=int, default=2, help="publisher processes, (b)")
    ap.add_argument("--no-process", action="store_true", help="(a) only")
    ap.add_argument(
        "--wildcard",
        action="store_true",
        help="(b)'s sidecar takes the wildcard (default: it names its engines, pool-scoped)",
    )
    ap.add_argument(
        "--ack-pace-ms",
        type=float,
        help="(b)'s sidecar ACKs EndpointState responses at most this often (default: "
        "control_plane.ack_pace_s's)",
    )
    ap.add_argument(
        "--push-interval-ms",
        type=float,
        default=0.0,
        help="(b)'s control plane flushes changes to its streams at most this often "
        "(push_interval_s; default 0: at once)",
    )
    ap.add_argument(
        "--transports",
        default="frames",
        help="(b)'s sidecar follows over these, a run each, alternated (grpc: "
        "control_plane.frames off; frames: the control plane's frames port, the default)",
    )
    ap.add_argument("--process-rounds", type=int, default=1, help="(b)'s runs of each transport")
    ap.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    args = ap.parse_args(argv)
    sizes = [int(k) for k in args.per_response.split(",")]

    out: dict[str, Any] = {"engines": args.engines, "apply": {}}
    print(
        f"(a) apply in-process: {args.engines} engines, {args.updates:,} updates a round, "
        f"CPU us per update (median of {args.rounds} rounds), cpus={os.cpu_count()}"
    )
    print(
        f"{'':>20}{'caches warm':^32}{'cold (2 ms asleep before each response)':^42}\n"
        f"{'resources/response':>20}{'before':>10}{'now':>10}{'now/before':>12}"
        f"{'before':>14}{'now':>14}{'now/before':>14}"
    )
    for k in sizes:
        s = bench_apply(args.engines, args.updates, k, args.rounds)
        r = {f"{name}_us": statistics.median(v) for name, v in s.items()}
        r["now_over_before"] = r["now_us"] / r["before_us"]
        r["cold_now_over_before"] = r["now_cold_us"] / r["before_cold_us"]
        out["apply"][str(k)] = r
        print(
            f"{k:>20}{r['before_us']:>10.2f}{r['now_us']:>10.2f}{r['now_over_before']:>12.2f}"
            f"{r['before_cold_us']:>14.2f}{r['now_cold_us']:>14.2f}"
            f"{r['cold_now_over_before']:>14.2f}"
        )
    if not args.no_process:
        from meshd.config_schema import ControlPlane

        default_ms = ControlPlane().ack_pace_s * 1e3
        pace_ms = default_ms if args.ack_pace_ms is None else args.ack_pace_ms
        transports = [t for t in args.transports.split(",") if t]
        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in transports}
        header = False
        for k in range(args.process_rounds):
            for transport in transports if k % 2 == 0 else transports[::-1]:
                r = bench_process(
                    args.engines,
                    args.rate,
                    args.duration,
                    args.batch,
                    args.publishers,
                    named=not args.wildcard,
                    ack_pace_s=None if args.ack_pace_ms is None else args.ack_pace_ms / 1e3,
                    transport=transport,
                    push_interval_s=args.push_interval_ms / 1e3,
                )
                r["ack_pace_ms"] = pace_ms
                r["push_interval_ms"] = args.push_interval_ms
                runs[transport].append(r)
                if not header:
                    header = True
                    print(
                        f"\n(b) one sidecar process following {r['engines_followed']:.0f} "
                        f"engines, {args.rate:,.0f} updates/s asked for {r['window_s']:.1f} s "
                        f"({args.publishers} publishers, {args.batch} engines a publish; "
                        f"subscribed {'with the wildcard' if args.wildcard else 'by name'}; "
                        f"ACKs at most every {pace_ms:g} ms; control plane pushes at most "
                        f"every {args.push_interval_ms:g} ms; transports {', '.join(transports)}"
                        f"{', alternated' if len(transports) > 1 else ''})"
                    )
                    print(
                        f"{'transport':>10}{'published/s':>12}{'applied/s':>11}{'CPU share':>11}"
                        f"{'us/update':>11}{'applying':>10}{'reading':>9}{'idle share':>12}"
                        f"{'at 10 Hz':>10}{'CP share':>10}{'pub share':>11}{'upd/resp':>10}"
                    )
                print(
                    f"{transport:>10}{r['published_per_s']:>12,.0f}{r['applied_per_s']:>11,.0f}"
                    f"{r['sidecar_cpu_share']:>11.1%}{r['sidecar_us_per_update']:>11.2f}"
                    f"{r['sidecar_apply_us_per_update']:>10.2f}"
                    f"{r['sidecar_read_us_per_update']:>9.2f}"
                    f"{r['sidecar_idle_share']:>12.2%}{r['sidecar_share_at_10hz']:>10.1%}"
                    f"{r['control_plane_cpu_share']:>10.0%}{r['publishers_cpu_share']:>11.0%}"
                    f"{r['updates_per_response']:>10.1f}"
                )
                if r["published_per_s"] < 0.95 * args.rate:
                    print(
                        "  publishers reached under 95% of the asked rate: the machine (or "
                        "the control plane's ingest) is short; us/update holds, the share is "
                        "at the rate applied"
                    )
        if len(transports) > 1 or args.process_rounds > 1:
            print("  median us/update (range):")
            for t, rs in runs.items():
                us = sorted(r["sidecar_us_per_update"] for r in rs)

                def mid(key: str, rs: list[dict[str, Any]] = rs) -> float:
                    return statistics.median(r[key] for r in rs)

                outside = statistics.median(
                    r["sidecar_us_per_update"] - r["sidecar_apply_us_per_update"] for r in rs
                )
                print(
                    f"  {t:>8}: {statistics.median(us):.2f} ({us[0]:.2f}-{us[-1]:.2f}), "
                    f"reading {mid('sidecar_read_us_per_update'):.2f}, applying "
                    f"{mid('sidecar_apply_us_per_update'):.2f}, outside the apply {outside:.2f}"
                )
        # `process`: the median run (by us/update) of the first transport named.
        first = sorted(runs[transports[0]], key=lambda r: r["sidecar_us_per_update"])
        out["process"] = first[len(first) // 2]
        out["process_runs"] = runs
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
