"""The control plane's memory with prefix digests (issue #23): its RSS, settled and peak,
holding `--engines` engines' states and full PrefixDigests of `--blocks` blocks each, over
real gRPC, phase by phase:

- states: every engine's EndpointState;
- restart: every engine's full digest at once (every publisher at full speed, as after a
  control-plane restart or a fleet-wide resync);
- joiners: `--subscribers` late joiners, each following the digests of `--follow` engines
  by name (a sidecar's pools), until each holds all of them;
- churn: `--churn-s` seconds of deltas on those bases (`--delta-blocks` added and removed
  each), every engine at `--rate`, a `--resync-share` of them full resyncs instead.

Settled is the RSS once it stopped moving after the phase (less than 1 MiB in 1 s, at
most 10 s); peak is the phase's VmHWM (reset before each phase through
/proc/PID/clear_refs). A digest block's cost is (restart's settled - states' settled) /
(engines x blocks).

`--before-tree PATH` runs the same phases first against the control plane of another
checkout (`git worktree add /tmp/meshd-before <rev>`; the publishers and subscribers are
this checkout's, the wire format being the same) and prints now / before per figure.

Run: .venv/bin/python -m loadtest.xds_memory_bench [--engines 1000] [--blocks 40000]
     [--subscribers 4] [--follow 250] [--churn-s 5] [--before-tree PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from loadtest import procstats
from loadtest.xds_scale_bench import T, engine_body_us, engine_name

DIGEST_T = "type.googleapis.com/meshd.v1.PrefixDigest"
DELTA_METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
TARGET_MB = 300.0  # issue #23: the control plane at 1,000 engines with digests
PHASES = ("states", "restart", "joiners", "churn")


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    settled_mib: float
    peak_mib: float
    seconds: float


# -- processes ----------------------------------------------------------------------------


def _control_plane(conn: Connection, tree: str | None) -> None:
    if tree:
        sys.path.insert(0, tree)
    import xds
    from xds.server import ControlPlane

    try:  # what `meshd control-plane` does first (a tree from before it has none)
        from xds.allocator import pin_mmap_threshold
    except ImportError:
        pass
    else:
        pin_mmap_threshold()

    async def main() -> None:
        cp = ControlPlane()
        port = await cp.start("127.0.0.1", 0)
        conn.send((port, os.getpid(), str(Path(xds.__file__).resolve().parent)))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await cp.stop(0.5)

    asyncio.run(main())


def digest_bytes(i: int, seq: int, base_seq: int, added: bytes, removed: bytes = b"") -> bytes:
    """Engine i's PrefixDigest with packed hashes, as PrefixDigest.encode lays it out
    (no tuple of ints: the publishers make hundreds of full digests a second)."""
    import msgpack

    from xds.resources import SCHEMA_VERSION

    out: bytes = msgpack.packb(
        {
            "v": SCHEMA_VERSION,
            "engine": engine_name(i),
            "epoch": f"{i:08x}",
            "seq": seq,
            "base_seq": base_seq,
            "full": seq == base_seq,
            "block_size": 16,
            "added": added,
            "removed": removed,
        }
    )
    return out


class EngineDigests:
    """One engine's digests in churn: full resyncs (a new random set: each a new body of
    `blocks` hashes) and deltas on the last one (`delta_blocks` of it removed, as many
    new ones added, every delta a new body)."""

    def __init__(self, i: int, blocks: int, delta_blocks: int) -> None:
        self.i, self.blocks, self.delta_blocks = i, blocks, delta_blocks
        self.seq = self.base_seq = 0

    def _base(self) -> bytes:
        return random.Random(self.i * 1_000_003 + self.base_seq).randbytes(8 * self.blocks)

    def full(self) -> bytes:
        """The first full digest (seq 1), or a resync."""
        self.seq += 1
        self.base_seq = self.seq
        return digest_bytes(self.i, self.seq, self.seq, self._base())

    def delta(self) -> bytes:
        self.seq += 1
        n = min(self.blocks, self.delta_blocks)
        added = random.Random(self.i * 7919 + self.seq).randbytes(8 * n)
        return digest_bytes(self.i, self.seq, self.base_seq, added, self._base()[: 8 * n])


def _publisher(conn: Connection, target: str, engines: list[int], args: dict[str, Any]) -> None:
    from xds.client import Publisher

    per_message = args["per_message"]
    nodes = [engines[j : j + per_message] for j in range(0, len(engines), per_message)]
    digests = {i: EngineDigests(i, args["blocks"], args["delta_blocks"]) for i in engines}

    async def main() -> None:
        # A publish stream per node, as each node's agent has its link (the control plane
        # holds per stream what it last received).
        options = [("grpc.max_send_message_length", 2**30)]
        pubs = [Publisher(target, channel_options=options) for _ in nodes]
        for pub, node in zip(pubs, nodes, strict=True):
            await pub.publish(T, {engine_name(i): engine_body_us(i, 0, 0) for i in node})
        conn.send("states")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        for pub, node in zip(pubs, nodes, strict=True):  # each body made just before sending
            await pub.publish(DIGEST_T, {engine_name(i): digests[i].full() for i in node})
        conn.send("restart")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        end = time.monotonic() + args["churn_s"]
        period = 1.0 / (args["rate"] * len(nodes))
        rng, n = random.Random(engines[0]), 0
        while time.monotonic() < end:
            bodies = {
                engine_name(i): digests[i].full()
                if rng.random() < args["resync_share"]
                else digests[i].delta()
                for i in nodes[n % len(nodes)]
            }
            await pubs[n % len(nodes)].publish(DIGEST_T, bodies)
            n += 1
            await asyncio.sleep(max(0.0, period - 0.0005))
        conn.send("churn")
        for pub in pubs:
            await pub.close()

    asyncio.run(main())


def _subscribers(conn: Connection, target: str, follows: list[list[str]]) -> None:
    """Thin late joiners: each subscribes to its engines' digests by name, counts what it
    receives (the protobuf parse, nothing decoded) and ACKs."""
    from envoy.service.discovery.v3 import discovery_pb2 as pb
    from grpc import aio

    import xds  # noqa: F401

    held = [set[str]() for _ in follows]

    async def follow(k: int, names: list[str]) -> None:
        options = [("grpc.max_receive_message_length", 2**30)]
        async with aio.insecure_channel(target, options=options) as ch:
            call = ch.stream_stream(
                DELTA_METHOD,
                request_serializer=pb.DeltaDiscoveryRequest.SerializeToString,
                response_deserializer=pb.DeltaDiscoveryResponse.FromString,
            )()
            first = pb.DeltaDiscoveryRequest(type_url=DIGEST_T, resource_names_subscribe=names)
            first.node.id = f"joiner-{os.getpid()}-{k}"
            await call.write(first)
            while True:
                resp = await call.read()
                if resp is aio.EOF:
                    return
                held[k].update(r.name for r in resp.resources)
                await call.write(
                    pb.DeltaDiscoveryRequest(type_url=resp.type_url, response_nonce=resp.nonce)
                )

    async def main() -> None:
        tasks = [asyncio.ensure_future(follow(k, names)) for k, names in enumerate(follows)]
        while not all(len(h) >= len(n) for h, n in zip(held, follows, strict=True)):
            await asyncio.sleep(0.05)
            for t in tasks:
                if t.done():
                    t.result()  # a stream that failed: say why
        conn.send("synced")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


# -- one run ------------------------------------------------------------------------------


def reset_peak(pid: int) -> None:
    """Set VmHWM back to the current RSS (proc(5), clear_refs: 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def settled_rss(pid: int, *, still_mib: float = 1.0, hold_s: float = 1.0) -> float:
    """The RSS (MiB) once it moved less than `still_mib` over `hold_s` (at most 10 s)."""
    give_up = time.monotonic() + 10.0
    last = procstats.memory(pid)[1] / 2**20
    while True:
        time.sleep(hold_s)
        now = procstats.memory(pid)[1] / 2**20
        if abs(now - last) < still_mib or time.monotonic() > give_up:
            return now
        last = now


def run(
    *,
    engines: int,
    blocks: int,
    per_message: int = 8,
    publishers: int = 2,
    subscribers: int = 4,
    follow: int = 250,
    churn_s: float = 5.0,
    rate: float = 0.5,
    delta_blocks: int = 64,
    resync_share: float = 0.05,
    tree: str | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> tuple[str, list[Phase]]:
    """The phases against one control plane; (the xds package it ran, phases)."""
    ctx = mp.get_context("spawn")
    procs: list[Any] = []

    def spawn(target: Callable[..., None], *a: Any) -> Connection:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, *a), daemon=True)
        p.start()
        procs.append(p)
        return parent

    phases: list[Phase] = []
    try:
        cp = spawn(_control_plane, tree)
        port, pid, package = cp.recv()
        target = f"127.0.0.1:{port}"
        opts = {
            "per_message": per_message,
            "blocks": blocks,
            "churn_s": churn_s,
            "rate": rate,
            "delta_blocks": delta_blocks,
            "resync_share": resync_share,
        }
        pubs = [
            spawn(_publisher, target, list(range(j, engines, publishers)), opts)
            for j in range(publishers)
        ]

        def phase(name: str, step: Callable[[], None]) -> None:
            reset_peak(pid)
            began = time.monotonic()
            step()
            took = time.monotonic() - began
            settled = settled_rss(pid)
            peak = procstats.memory(pid)[0] / 2**20
            phases.append(Phase(name, settled, peak, took))
            say(f"  {name:8} settled {settled:6.0f} MiB  peak {peak:6.0f} MiB  ({took:.1f} s)")

        def published(word: str) -> Callable[[], None]:
            def step() -> None:
                if word != "states":
                    for p in pubs:
                        p.send(word)
                for p in pubs:
                    assert p.recv() == word

            return step

        phase("states", published("states"))
        phase("restart", published("restart"))
        rng = random.Random(0)
        follows = [
            [engine_name(i) for i in sorted(rng.sample(range(engines), min(follow, engines)))]
            for _ in range(subscribers)
        ]
        subs: list[Connection] = []

        def join() -> None:
            per_process = 2
            for k in range(0, subscribers, per_process):
                subs.append(spawn(_subscribers, target, follows[k : k + per_process]))
            for s in subs:
                assert s.recv() == "synced"

        if subscribers:
            phase("joiners", join)
        if churn_s > 0:
            phase("churn", published("churn"))
        for s in subs:
            s.send("stop")
        cp.send("stop")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return package, phases


def report(
    phases: Sequence[Phase], before: Sequence[Phase] | None, engines: int, blocks: int
) -> list[str]:
    by = {p.name: p for p in phases}
    old = {p.name: p for p in before or ()}
    lines = [f"{'phase':8} {'settled':>17} {'peak':>17}" + ("   now/before" if before else "")]
    for p in phases:
        line = f"{p.name:8} {p.settled_mib:6.0f} MiB {p.settled_mib * 2**20 / 1e6:5.0f} MB"
        line += f" {p.peak_mib:6.0f} MiB {p.peak_mib * 2**20 / 1e6:5.0f} MB"
        o = old.get(p.name)
        if o is not None:
            line += f"   settled {p.settled_mib / o.settled_mib:.2f}x, peak "
            line += f"{p.peak_mib / o.peak_mib:.2f}x"
        lines.append(line)
    if "states" in by and "restart" in by and blocks:
        grew = (by["restart"].settled_mib - by["states"].settled_mib) * 2**20
        lines.append(f"a digest block: {grew / (engines * blocks):.2f} bytes settled")
    top = max(phases, key=lambda p: p.settled_mib)
    peak = max(phases, key=lambda p: p.peak_mib)
    s_mb, p_mb = top.settled_mib * 2**20 / 1e6, peak.peak_mib * 2**20 / 1e6
    verdict = "PASS" if max(s_mb, p_mb) <= TARGET_MB else "FAIL"
    lines.append(
        f"{verdict}: RSS <= {TARGET_MB:g} MB ({engines:,} engines, digests of {blocks:,} "
        f"blocks): settled {s_mb:.0f} MB ({top.name}), peak {p_mb:.0f} MB ({peak.name})"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--blocks", type=int, default=40_000, help="blocks per full digest")
    ap.add_argument("--per-message", type=int, default=8, help="engines a publish message")
    ap.add_argument("--publishers", type=int, default=2, help="publisher processes")
    ap.add_argument("--subscribers", type=int, default=4, help="late joiners (digests)")
    ap.add_argument("--follow", type=int, default=250, help="engines each joiner follows")
    ap.add_argument("--churn-s", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=0.5, help="digests/s an engine in churn")
    ap.add_argument("--delta-blocks", type=int, default=64)
    ap.add_argument("--resync-share", type=float, default=0.05)
    ap.add_argument("--before-tree", help="a checkout whose control plane runs first")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    kw: dict[str, Any] = {
        "engines": args.engines,
        "blocks": args.blocks,
        "per_message": args.per_message,
        "publishers": args.publishers,
        "subscribers": args.subscribers,
        "follow": args.follow,
        "churn_s": args.churn_s,
        "rate": args.rate,
        "delta_blocks": args.delta_blocks,
        "resync_share": args.resync_share,
    }
    print(
        f"control-plane RSS: {args.engines:,} engines, full digests of {args.blocks:,} blocks, "
        f"{args.subscribers} joiners of {args.follow} engines, {args.churn_s:g} s churn"
    )
    before: list[Phase] | None = None
    if args.before_tree:
        print(f"before ({args.before_tree}):")
        package, before = run(**kw, tree=args.before_tree, say=print)
        if not package.startswith(str(Path(args.before_tree).resolve())):
            raise SystemExit(f"the control plane ran {package}, not the tree given")
        print("now:")
    package, now = run(**kw, say=print)
    print(f"control plane: {package}")
    if before is not None:
        print("before:")
        for line in report(before, None, args.engines, args.blocks):
            print("  " + line)
        print("now:")
    for line in report(now, before, args.engines, args.blocks):
        print("  " + line if before is not None else line)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "settings": kw,
                    "before": [asdict(p) for p in before] if before else None,
                    "now": [asdict(p) for p in now],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
