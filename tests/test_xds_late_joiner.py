"""The late joiner under load, over real gRPC (issue #23): engines publish a burst of
PrefixDigests (fulls at random, deltas on them, a restart now and then) through a real
control plane with a push interval, while sidecar-like subscribers join at random moments
of the burst; within one push interval of the burst's end (plus scheduling slack) every
subscriber, applying what it receives as the sidecar does (ReportedBlocks), holds each
engine's true block set. tests/test_xds_digest_bases.py checks the same in process, step
by step; this one checks it at speed, with the transport between."""

from __future__ import annotations

import asyncio
import random

import pytest
from test_xds_digest_bases import Engine as DigestEngine

from filters.endpoint_state import ReportedBlocks
from xds.client import Backoff, Publisher, Subscriber, Update
from xds.resources import PREFIX_DIGEST_TYPE, PrefixDigest
from xds.server import ControlPlane, ServerLimits

T = PREFIX_DIGEST_TYPE
PUSH_S = 0.05
ENGINES = 12
# Measured here: 0.03-0.053 s after the burst's last publish (one push interval); the
# slack is a busy 2-core CI machine's scheduling, not the protocol's.
SLACK_S = 0.5


class Engine(DigestEngine):
    def step(self) -> bytes:
        """One churn and the digest an agent would publish for it: full at a restart
        (now and then) and at random, else a delta on the last full one."""
        if self.rng.random() < 0.03:  # a restart: a new epoch starts from nothing
            self.restart()
        self.churn()
        return self.digest(full=self.seq == 0 or self.rng.random() < 0.15)


class Follower:
    """A subscriber that rebuilds each engine's blocks as the sidecar's control feed does."""

    def __init__(self, port: int, k: int) -> None:
        self.blocks: dict[str, ReportedBlocks] = {}
        self.sub = Subscriber(
            f"127.0.0.1:{port}",
            {T: None},  # every engine (wildcard)
            backoff=Backoff(base_s=0.02, max_s=0.2),
            on_update=self._on_update,
            rng=random.Random(k),
        )

    def _on_update(self, u: Update) -> None:
        for name, entry in u.changed.items():
            d = entry.value
            if isinstance(d, PrefixDigest):
                self.blocks.setdefault(name, ReportedBlocks()).apply(d, 0.0)
        for name in u.removed:
            self.blocks.pop(name, None)

    def holds(self, e: Engine) -> frozenset[int] | None:
        b = self.blocks.get(e.name)
        return None if b is None or b.epoch is None else b.blocks


@pytest.mark.parametrize("seed", [1, 2])
async def test_subscribers_joining_during_a_burst_hold_every_engines_blocks(seed: int) -> None:
    rng = random.Random(seed)
    plane = ControlPlane(limits=ServerLimits(push_interval_s=PUSH_S), eds=False)
    await plane.start("127.0.0.1", 0)
    engines = [Engine(f"eng-{i:02d}", rng) for i in range(ENGINES)]
    pubs = [Publisher(f"127.0.0.1:{plane.port}") for _ in range(3)]
    followers: list[Follower] = []
    try:
        for step in range(400):  # ~1 s of digests from every engine, joins among them
            e = engines[step % ENGINES]
            await pubs[step % 3].publish(T, {e.name: e.step()})
            if step % 40 == 17 and len(followers) < 6:
                f = Follower(plane.port, step)
                f.sub.start()
                followers.append(f)
            if rng.random() < 0.1:
                await asyncio.sleep(rng.random() * PUSH_S)
        truth = {e.name: frozenset(e.blocks) for e in engines}

        def converged() -> bool:
            return all(f.holds(e) == truth[e.name] for f in followers for e in engines)

        loop = asyncio.get_running_loop()
        burst_end = loop.time()
        deadline = burst_end + PUSH_S + SLACK_S
        while not converged() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for k, f in enumerate(followers):
            for e in engines:
                assert f.holds(e) == truth[e.name], (k, e.name)
    finally:
        for f in followers:
            await f.sub.close()
        for p in pubs:
            await p.close()
        await plane.stop(0)
