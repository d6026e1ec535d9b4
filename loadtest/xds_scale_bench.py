"""The control channel at fleet scale: E simulated engines publish EndpointState at `rate`
updates per second each, through one control plane (its own process, EDS view on), to N
subscribers; measured per scenario in one run, and compared with the first (delta, one
subscriber) as ratios:

- update latency p50/p99/max: publish call started -> subscriber applied it (the publish
  time travels in the resource's `tokens_in_flight` field, in microseconds: a per-request
  figure the EDS view leaves out, so the engine's EDS metadata stays as stable as a real
  one's; CLOCK_MONOTONIC is system wide, so the processes share it);
- control-plane CPU per published update and CPU share; its RSS (current and peak);
- bytes per second each subscriber receives (protobuf size of the responses), and the share
  of updates it saw (a subscriber that lags gets the latest of each resource: coalesced);
- achieved publish rate (the publishers may fall behind the target on a busy machine).

Scenarios: delta x1 (baseline), SotW x1 (state of the world: every response carries every
engine), delta xN. Processes: the control plane, one publisher process (`--streams` publish
streams), and subscriber processes of up to `--per-process` subscribers each; on a small
machine they all share the cores, so latency includes waiting for a CPU.

Run: .venv/bin/python -m loadtest.xds_scale_bench [--quick] [--engines 1000] [--rate 1]
     [--subscribers 100] [--duration 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from loadtest import procstats

T = "type.googleapis.com/meshd.v1.EndpointState"
SOTW_METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    mode: str  # "delta" or "sotw"
    subscribers: int


# -- the engines' updates -----------------------------------------------------------------


def published_us(t: float) -> int:
    """A CLOCK_MONOTONIC reading in whole microseconds (an int field carries it)."""
    return round(t * 1e6)


def engine_body(i: int, seq: int, published_at: float) -> bytes:
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
        tokens_in_flight=published_us(published_at),  # the bench's clock
        ttft_s=round(rng.uniform(0.05, 0.5), 4),
        tpot_s=round(rng.uniform(0.01, 0.04), 4),
        epoch=f"{i:08x}",  # stable, as a running engine's
    ).encode()


# -- processes ----------------------------------------------------------------------------


def _control_plane(conn: Connection, push_interval_s: float) -> None:
    import xds  # noqa: F401
    from xds.server import ControlPlane, ServerLimits

    async def main() -> None:
        # (ServerLimits() alone when 0, so the bench also runs against an older server.)
        limits = ServerLimits(push_interval_s=push_interval_s) if push_interval_s else None
        cp = ControlPlane(limits=limits)
        port = await cp.start("127.0.0.1", 0)
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        conn.send(
            {"responses": sum(cp.stats.responses.values()), "acks": sum(cp.stats.acks.values())}
        )
        await cp.stop(0)

    asyncio.run(main())


def _publisher(conn: Connection, port: int, engines: int, rate: float, streams: int) -> None:
    from xds.client import Publisher

    async def main() -> None:
        pubs = [Publisher(f"127.0.0.1:{port}") for _ in range(streams)]
        seq = [0] * engines

        async def publish(k: int, i: int) -> None:
            seq[i] += 1
            t = time.monotonic()
            await pubs[k].publish(T, {f"engine-{i:05d}": engine_body(i, seq[i], t)})

        # Everyone once, so subscribers can sync before the clock starts.
        for i in range(engines):
            await publish(i % streams, i)
        conn.send("published")
        start, end = conn.recv()
        counts = [0] * streams

        async def stream(k: int) -> None:
            mine = list(range(k, engines, streams))
            if not mine:
                return
            period = 1.0 / (rate * len(mine))  # this stream's engines, spread evenly
            t0 = time.monotonic() + random.random() * period
            n = 0
            while True:
                due = t0 + n * period
                now = time.monotonic()
                if due > now:
                    await asyncio.sleep(due - now)
                if time.monotonic() >= end:
                    return
                began = time.monotonic()
                await publish(k, mine[n % len(mine)])
                if began >= start:
                    counts[k] += 1
                n += 1

        await asyncio.gather(*(stream(k) for k in range(streams)))
        conn.send(sum(counts))
        for p in pubs:
            await p.close()

    asyncio.run(main())


class _Window:
    """Latencies and bytes of what a subscriber receives inside the measurement window."""

    def __init__(self) -> None:
        self.start = float("inf")
        self.end = float("inf")
        self.latencies = array("d")
        self.bytes = 0
        self.responses = 0

    def seen(self, published_at: float, now: float) -> None:
        if self.start <= published_at < self.end:
            self.latencies.append(now - published_at)

    def response(self, size: int, now: float) -> None:
        if self.start <= now < self.end:
            self.bytes += size
            self.responses += 1


def _subscribers(conn: Connection, port: int, n: int, mode: str, engines: int) -> None:
    from envoy.service.discovery.v3 import discovery_pb2 as pb
    from grpc import aio

    import xds  # noqa: F401
    from xds.client import Backoff, Subscriber, Update
    from xds.resources import EndpointState, decode_endpoint_state

    target = f"127.0.0.1:{port}"
    windows = [_Window() for _ in range(n)]
    counts = [0] * n

    class Counting(Subscriber):
        """The real subscriber, counting the bytes of each response it applies."""

        window: _Window

        def _apply(self, resp: pb.DeltaDiscoveryResponse) -> pb.DeltaDiscoveryRequest:
            self.window.response(resp.ByteSize(), time.monotonic())
            return super()._apply(resp)

    def delta(k: int) -> Counting:
        w = windows[k]

        def on_update(u: Update) -> None:
            now = time.monotonic()
            for e in u.changed.values():
                assert isinstance(e.value, EndpointState)
                w.seen(e.value.tokens_in_flight / 1e6, now)

        sub = Counting(target, {T: None}, backoff=Backoff(0.05, 1.0), on_update=on_update)
        sub.window = w
        return sub

    async def sotw(k: int) -> None:
        w = windows[k]
        versions: dict[str, str] = {}
        async with aio.insecure_channel(target) as ch:
            call = ch.stream_stream(
                SOTW_METHOD,
                request_serializer=pb.DiscoveryRequest.SerializeToString,
                response_deserializer=pb.DiscoveryResponse.FromString,
            )()
            await call.write(pb.DiscoveryRequest(type_url=T))
            while True:
                resp = await call.read()
                if resp is aio.EOF:
                    return
                now = time.monotonic()
                w.response(resp.ByteSize(), now)
                for any_ in resp.resources:
                    inner = pb.Resource.FromString(any_.value)
                    if versions.get(inner.name) != inner.version:
                        versions[inner.name] = inner.version
                        state = decode_endpoint_state(inner.resource.value)
                        w.seen(state.tokens_in_flight / 1e6, now)
                counts[k] = len(versions)
                await call.write(
                    pb.DiscoveryRequest(
                        type_url=T, version_info=resp.version_info, response_nonce=resp.nonce
                    )
                )

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        subs: list[Counting] = []
        if mode == "delta":
            subs = [delta(k) for k in range(n)]
            for s in subs:
                s.start()
        else:
            tasks = [asyncio.ensure_future(sotw(k)) for k in range(n)]

        def synced() -> bool:
            if subs:
                return all(len(s.entries(T)) >= engines for s in subs)
            return all(c >= engines for c in counts)

        while not synced():
            await asyncio.sleep(0.05)
        conn.send("synced")
        loop = asyncio.get_running_loop()
        start, end = await loop.run_in_executor(None, conn.recv)
        for w in windows:
            w.start, w.end = start, end
        # Until the window closed and what was published in it had time to arrive.
        await loop.run_in_executor(None, conn.recv)
        cpu = time.process_time()
        for s in subs:
            await s.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        conn.send(
            {
                "latencies": [w.latencies.tobytes() for w in windows],
                "bytes": [w.bytes for w in windows],
                "responses": [w.responses for w in windows],
                "cpu_s": cpu,
            }
        )

    asyncio.run(main())


# -- one scenario -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    scenario: Scenario
    published: int
    window_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    seen_share: float  # updates seen / (published x subscribers)
    bytes_per_s: float  # per subscriber, mean
    cp_cpu_us_per_update: float
    cp_cpu_share: float
    cp_rss_mib: float
    cp_peak_rss_mib: float
    # Where the rest of the machine went, in the window: the publisher process's CPU per
    # publish, and the subscriber processes' CPU per update applied (one subscriber's).
    pub_cpu_us_per_update: float = float("nan")
    sub_cpu_us_per_update: float = float("nan")
    machine_cpu_share: float = float("nan")  # all of the bench's processes / window


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run_scenario(
    sc: Scenario,
    *,
    engines: int,
    rate: float,
    duration_s: float,
    streams: int,
    per_process: int,
    push_interval_s: float = 0.0,
    tick: Callable[[float], None] = lambda s: None,
) -> Result:
    ctx = mp.get_context("spawn")
    procs: list[Any] = []

    def spawn(target: Callable[..., None], *args: Any) -> Connection:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        procs.append(p)
        return parent

    try:
        cp = spawn(_control_plane, push_interval_s)
        port = cp.recv()
        cp_pid = procs[0].pid
        pub = spawn(_publisher, port, engines, rate, streams)
        assert pub.recv() == "published"
        groups = [
            min(per_process, sc.subscribers - k) for k in range(0, sc.subscribers, per_process)
        ]
        subs = [spawn(_subscribers, port, g, sc.mode, engines) for g in groups]
        for s in subs:
            assert s.recv() == "synced"
        start = time.monotonic() + 0.5
        end = start + duration_s
        pub.send((start, end))
        for s in subs:
            s.send((start, end))
        while time.monotonic() < start:
            time.sleep(0.01)
        others = [p.pid for p in procs[1:] if p.pid is not None]
        before = procstats.sample(cp_pid)
        before_others = [procstats.sample(pid) for pid in others]
        t = start
        while t < end:
            time.sleep(min(1.0, end - t))
            tick(min(1.0, end - t))
            t = time.monotonic()
        after = procstats.sample(cp_pid)
        after_others = [procstats.sample(pid) for pid in others]
        published = pub.recv()
        time.sleep(min(2.0, 0.25 + duration_s * 0.05))  # the window's last updates land
        lat: list[float] = []
        bytes_: list[int] = []
        for s in subs:
            s.send("stop")
            r = s.recv()
            for raw in r["latencies"]:
                a = array("d")
                a.frombytes(raw)
                lat.extend(a)
            bytes_.extend(r["bytes"])
        cp.send("stop")
        cp.recv()
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    lat.sort()
    window = end - start
    cpu = after.cpu_since(before)
    other_cpu = [a.cpu_since(b) for a, b in zip(after_others, before_others, strict=True)]
    pub_cpu, sub_cpu = other_cpu[0], sum(other_cpu[1:])
    return Result(
        scenario=sc,
        published=published,
        window_s=window,
        p50_ms=_quantile(lat, 0.5) * 1e3,
        p99_ms=_quantile(lat, 0.99) * 1e3,
        max_ms=(lat[-1] if lat else float("nan")) * 1e3,
        seen_share=len(lat) / max(1, published * sc.subscribers),
        bytes_per_s=statistics.fmean(bytes_) / window if bytes_ else 0.0,
        cp_cpu_us_per_update=cpu / max(1, published) * 1e6,
        cp_cpu_share=cpu / window,
        cp_rss_mib=after.rss / 2**20,
        cp_peak_rss_mib=after.peak_rss / 2**20,
        pub_cpu_us_per_update=pub_cpu / max(1, published) * 1e6,
        sub_cpu_us_per_update=sub_cpu / max(1, len(lat)) * 1e6,
        machine_cpu_share=(cpu + pub_cpu + sub_cpu) / window,
    )


# -- report -------------------------------------------------------------------------------


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:,.1f} {unit}"
        b /= 1024
    return f"{b:.1f}"


def report(results: list[Result], *, engines: int, rate: float) -> str:
    lines = [
        f"{engines} engines x {rate:g} updates/s each (target {engines * rate:,.0f}/s), "
        f"cpus={os.cpu_count()}",
        f"{'scenario':<12}{'pub/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'seen':>7}"
        f"{'bytes/s/sub':>14}{'CP us/upd':>11}{'CP cpu':>8}{'CP RSS':>9}{'peak':>8}",
    ]
    for r in results:
        lines.append(
            f"{r.scenario.name:<12}{r.published / r.window_s:>9,.0f}{r.p50_ms:>9.2f}"
            f"{r.p99_ms:>9.2f}{r.max_ms:>9.1f}{r.seen_share:>7.0%}"
            f"{_fmt_bytes(r.bytes_per_s):>14}{r.cp_cpu_us_per_update:>11.1f}"
            f"{r.cp_cpu_share:>8.0%}{r.cp_rss_mib:>7.0f}Mi{r.cp_peak_rss_mib:>6.0f}Mi"
        )
    lines.append("CPU elsewhere: publisher us/publish, subscriber us/update applied, all processes")
    for r in results:
        lines.append(
            f"  {r.scenario.name:<10} publisher {r.pub_cpu_us_per_update:7.1f}  "
            f"subscriber {r.sub_cpu_us_per_update:7.1f}  "
            f"bench total {r.machine_cpu_share:5.0%} of one core"
        )
    base = results[0]
    lines.append(f"ratios against {base.scenario.name}:")
    for r in results[1:]:
        lines.append(
            f"  {r.scenario.name:<10} p99 x{r.p99_ms / base.p99_ms:.2f}  "
            f"CP CPU/update x{r.cp_cpu_us_per_update / base.cp_cpu_us_per_update:.2f}  "
            f"bytes/s per subscriber x{r.bytes_per_s / max(1.0, base.bytes_per_s):.2f}"
        )
    sotw = next((r for r in results if r.scenario.mode == "sotw"), None)
    if sotw is not None and base.bytes_per_s:
        lines.append(
            f"delta sends {sotw.bytes_per_s / base.bytes_per_s:.1f}x fewer bytes than "
            "state-of-the-world per subscriber"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short windows, 10 subscribers (<60 s)")
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=1.0, help="updates per second per engine")
    ap.add_argument("--subscribers", type=int, default=100, help="N of the delta xN scenario")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per scenario window")
    ap.add_argument("--streams", type=int, default=16, help="publish streams")
    ap.add_argument("--per-process", type=int, default=25, help="subscribers per process")
    ap.add_argument(
        "--push-interval",
        type=float,
        default=0.0,
        help="the control plane's push_interval_s (seconds; 0: every loop turn)",
    )
    ap.add_argument("--no-sotw", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.subscribers = min(args.subscribers, 10)
        args.duration = min(args.duration, 6.0)
    scenarios = [Scenario("delta x1", "delta", 1)]
    if not args.no_sotw:
        scenarios.append(Scenario("sotw x1", "sotw", 1))
    if args.subscribers > 1:
        scenarios.append(Scenario(f"delta x{args.subscribers}", "delta", args.subscribers))

    from tqdm import tqdm

    bar = tqdm(
        total=round(args.duration * len(scenarios)),
        desc="measuring (s)",
        disable=args.no_progress or not sys.stderr.isatty(),
    )
    results = []
    with contextlib.closing(bar):
        for sc in scenarios:
            bar.set_postfix_str(sc.name)
            results.append(
                run_scenario(
                    sc,
                    engines=args.engines,
                    rate=args.rate,
                    duration_s=args.duration,
                    streams=args.streams,
                    per_process=args.per_process,
                    push_interval_s=args.push_interval,
                    tick=lambda s: bar.update(round(s)),
                )
            )
    print(report(results, engines=args.engines, rate=args.rate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
