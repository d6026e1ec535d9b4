"""The agent's per-control-plane link coalesces what it could not send yet to the latest
body of each resource, but a full PrefixDigest is never displaced unsent by the deltas
built on it (they are relative to it: a control plane given only the delta holds a digest
no subscriber can apply). Found as a CI flake of tests/test_agent.py: a full digest made
after a failed publish, then a delta, both offered during the backoff; only the delta went.

A fake Publisher records what each publish call carried, and fails on demand."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from meshd import agent_link as link_mod
from meshd.agent import AgentStats
from meshd.agent_link import ControlPlaneLink
from xds.client import Backoff

DIGEST = "type.googleapis.com/meshd.v1.PrefixDigest"
STATE = "type.googleapis.com/meshd.v1.EndpointState"


@dataclass
class FakeAgent:
    stats: AgentStats = field(default_factory=AgentStats)
    lost: int = 0
    credentials: None = None
    ssl_context: None = None

    @dataclass
    class _Config:
        backoff: Backoff = field(default_factory=lambda: Backoff(base_s=0.001, max_s=0.002))

    config: _Config = field(default_factory=_Config)

    def on_link_lost(self) -> None:
        self.lost += 1


class FakePublisher:
    sent: list[tuple[str, dict[str, bytes]]] = []
    fail_next = 0
    gate: asyncio.Event | None = None  # when set: publish waits for it (a slow send)
    frames_port: int | None = None  # no frames port advertised: the link stays on it

    def __init__(self, target: str, *, credentials: object = None) -> None:
        self.target = target

    async def publish(self, type_url: str, resources: dict[str, bytes]) -> None:
        if FakePublisher.gate is not None:
            await FakePublisher.gate.wait()
        if FakePublisher.fail_next > 0:
            FakePublisher.fail_next -= 1
            raise ConnectionError("control plane away")
        FakePublisher.sent.append((type_url, dict(resources)))

    async def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def fake_publisher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    FakePublisher.sent = []
    FakePublisher.fail_next = 0
    FakePublisher.gate = None
    monkeypatch.setattr(link_mod, "Publisher", FakePublisher)
    yield


def make_link() -> tuple[ControlPlaneLink, FakeAgent]:
    fake = FakeAgent()
    return ControlPlaneLink(fake, "127.0.0.1:1"), fake  # type: ignore[arg-type]


async def until_sent(n: int) -> None:
    async with asyncio.timeout(5.0):
        while len(FakePublisher.sent) < n:
            await asyncio.sleep(0.001)


async def until_taken(link: ControlPlaneLink) -> None:
    """The link's task has taken everything pending into a send (held at the gate)."""
    async with asyncio.timeout(5.0):
        while link._pending:
            await asyncio.sleep(0)


def digests() -> list[bytes]:
    return [r["e"] for t, r in FakePublisher.sent if t == DIGEST]


async def test_a_delta_does_not_displace_the_unsent_full_it_builds_on() -> None:
    link, _ = make_link()
    link.offer(DIGEST, "e", b"full-2", base=True)
    link.offer(DIGEST, "e", b"delta-3")
    link.offer(DIGEST, "e", b"delta-4")  # cumulative since full-2: replaces delta-3
    link.offer(STATE, "e", b"state-1")
    link.offer(STATE, "e", b"state-2")
    link.start()
    try:
        await until_sent(3)
        assert digests() == [b"full-2", b"delta-4"]
        assert [r["e"] for t, r in FakePublisher.sent if t == STATE] == [b"state-2"]
    finally:
        await link.close()


async def test_a_newer_full_supersedes_the_older_one_and_its_deltas() -> None:
    link, _ = make_link()
    link.offer(DIGEST, "e", b"full-2", base=True)
    link.offer(DIGEST, "e", b"delta-3")
    link.offer(DIGEST, "e", b"full-4", base=True)
    link.start()
    try:
        await until_sent(1)
        link.offer(DIGEST, "e", b"delta-5")
        await until_sent(2)
        assert digests() == [b"full-4", b"delta-5"]
    finally:
        await link.close()


async def test_what_failed_goes_again_before_what_was_offered_during_the_send() -> None:
    link, fake = make_link()
    FakePublisher.gate = asyncio.Event()
    FakePublisher.fail_next = 1
    link.offer(DIGEST, "e", b"full-2", base=True)
    link.start()
    try:
        # The send of full-2 is in flight (and will fail); a delta built on it arrives.
        await until_taken(link)
        link.offer(DIGEST, "e", b"delta-3")
        FakePublisher.gate.set()
        await until_sent(2)
        assert digests() == [b"full-2", b"delta-3"]
        assert fake.lost == 1 and fake.stats.publish_failures == 1
    finally:
        await link.close()


async def test_a_failed_send_yields_to_a_newer_full_offered_meanwhile() -> None:
    link, _ = make_link()
    FakePublisher.gate = asyncio.Event()
    FakePublisher.fail_next = 1
    link.offer(DIGEST, "e", b"full-2", base=True)
    link.offer(DIGEST, "e", b"delta-3")
    link.start()
    try:
        await until_taken(link)
        link.offer(DIGEST, "e", b"full-4", base=True)  # the agent resyncs after the loss
        FakePublisher.gate.set()
        await until_sent(1)
        link.offer(STATE, "e", b"marker")  # anything requeued would go before it
        await until_sent(2)
        assert digests() == [b"full-4"]
    finally:
        await link.close()


async def test_close_ends_a_link_waiting_for_work() -> None:
    link, _ = make_link()
    link.start()
    await asyncio.sleep(0)  # the task is now waiting for an offer
    async with asyncio.timeout(5.0):
        await link.close()
    assert link._task is not None and link._task.done()


@pytest.mark.parametrize("window_s", [0.0, 0.05])
async def test_a_window_gathers_what_several_engines_offer_into_one_message(
    window_s: float,
) -> None:
    fake = FakeAgent()
    link = ControlPlaneLink(fake, "127.0.0.1:1", window_s=window_s)  # type: ignore[arg-type]
    link.start()
    try:
        for i in range(4):  # a node's engines, each on its own tick
            link.offer(STATE, f"engine-{i}", b"s%d" % i)
            await asyncio.sleep(0.005)
        await until_sent(1)
        await asyncio.sleep(window_s + 0.02)
    finally:
        await link.close()
    sizes = [len(resources) for _, resources in FakePublisher.sent]
    assert sum(sizes) == 4
    # Without a window the first engine's body leaves alone, at once; with one, together.
    assert sizes == ([4] if window_s else [1, *sizes[1:]]) and (window_s or len(sizes) > 1)
    assert fake.stats.publishes == 4 and fake.stats.publish_messages == len(sizes)
