"""The control plane never leaves a subscriber holding a PrefixDigest delta whose base it
did not see (xds/server.py, _DigestBases): a subscriber that joins after an engine's last
full digest, or whose full digest was coalesced away (published then built on within one
flush, or while its previous response was unanswered), gets the base first and the delta
next, on the delta path, in lockstep and in state-of-the-world. Checked by applying what
each subscriber receives the way the sidecar does (filters.endpoint_state.ReportedBlocks)
and comparing with the engine's true block set."""

from __future__ import annotations

import random

import pytest
from envoy.service.discovery.v3 import discovery_pb2 as pb

from filters.endpoint_state import ReportedBlocks
from xds.resources import PREFIX_DIGEST_TYPE, PrefixDigest, decode_prefix_digest
from xds.server import ControlPlane, _Stream, _Subscription

T = PREFIX_DIGEST_TYPE


class Engine:
    """An agent's digests of one engine: full at a resync, else cumulative since the last
    full one (meshd/agent.py, filters/kv_digest.py)."""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.name, self.rng = name, rng
        self.epoch, self.seq = "e1", 0
        self.blocks: set[int] = set()
        self.base: frozenset[int] = frozenset()
        self.base_seq = 0

    def churn(self) -> None:
        for _ in range(self.rng.randint(1, 4)):
            if self.blocks and self.rng.random() < 0.3:
                self.blocks.discard(self.rng.choice(sorted(self.blocks)))
            else:
                self.blocks.add(self.rng.getrandbits(63))

    def digest(self, full: bool) -> bytes:
        self.seq += 1
        if full:
            self.base, self.base_seq = frozenset(self.blocks), self.seq
            d = PrefixDigest(self.name, self.epoch, self.seq, self.seq, True, 16, tuple(self.base))
        else:
            d = PrefixDigest(
                self.name,
                self.epoch,
                self.seq,
                self.base_seq,
                False,
                16,
                tuple(self.blocks - self.base),
                tuple(self.base - self.blocks),
            )
        return d.encode()

    def restart(self) -> None:
        self.epoch = f"e{int(self.epoch[1:]) + 1}"
        self.seq, self.blocks = 0, set()


def publish(cp: ControlPlane, e: Engine, full: bool) -> None:
    cp.publish(T, {e.name: e.digest(full)})


class Client:
    """An in-process subscriber (delta or state-of-the-world) that applies each digest it
    receives to its engines' ReportedBlocks, as the sidecar's control feed does."""

    def __init__(self, cp: ControlPlane, k: int, names: list[str] | None, delta: bool) -> None:
        self.stream = _Stream(cp, f"client-{k}", delta=delta)
        cp._streams.add(self.stream)
        self.delta = delta
        self.blocks: dict[str, ReportedBlocks] = {}
        self.received: list[tuple[str, bool, int]] = []  # (name, full, seq) in order
        self.unanswered: list[str] = []
        if delta:
            self.stream.on_delta_request(
                pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=names or ["*"])
            )
        else:
            self.stream.on_sotw_request(pb.DiscoveryRequest(type_url=T, resource_names=names or []))

    @property
    def sub(self) -> _Subscription:
        return self.stream.subs[T]

    def _apply(self, name: str, body: bytes) -> None:
        d = decode_prefix_digest(body)
        self.received.append((name, d.full, d.seq))
        self.blocks.setdefault(name, ReportedBlocks()).apply(d, 0.0)

    def receive(self) -> bool:
        if len(self.sub.unacked) >= self.stream.cp.limits.max_unacked_per_type:
            return False
        push = self.stream.next_push(self.sub)
        if push is None:
            return False
        if self.delta:
            resp = pb.DeltaDiscoveryResponse.FromString(push.payload)
            names = [r.name for r in resp.resources]
            assert len(names) == len(set(names)), "one resource twice in a response"
            for r in resp.resources:
                self._apply(r.name, r.resource.value)
            for n in resp.removed_resources:
                self.blocks.pop(n, None)
        else:
            sresp = pb.DiscoveryResponse.FromString(push.payload)
            for a in sresp.resources:
                inner = pb.Resource.FromString(a.value)
                self._apply(inner.name, inner.resource.value)
        self.unanswered.append(push.nonce)
        return True

    def ack(self) -> None:
        for nonce in self.unanswered:
            if self.delta:
                self.stream.on_delta_request(
                    pb.DeltaDiscoveryRequest(type_url=T, response_nonce=nonce)
                )
            else:
                names = sorted(self.sub.names)
                self.stream.on_sotw_request(
                    pb.DiscoveryRequest(type_url=T, response_nonce=nonce, resource_names=names)
                )
        self.unanswered.clear()

    def holds(self, e: Engine) -> frozenset[int] | None:
        b = self.blocks.get(e.name)
        return None if b is None or b.epoch is None else b.blocks


def settle(cp: ControlPlane, clients: list[Client]) -> None:
    """Flush, then every client answers and takes what is due until nothing is."""
    for _ in range(4):  # a base sent by a flush is followed by its delta at the next
        cp.flush()
        for c in clients:
            c.ack()
        while any([c.receive() for c in clients]):
            for c in clients:
                c.ack()


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "sotw"])
def test_a_late_subscriber_gets_the_base_then_the_delta(delta: bool) -> None:
    cp = ControlPlane(eds=False)
    e = Engine("eng-a", random.Random(1))
    e.churn()
    publish(cp, e, full=True)
    e.churn()
    publish(cp, e, full=False)  # the cache now holds only this delta
    c = Client(cp, 0, ["eng-a"], delta=delta)
    settle(cp, [c])
    assert c.received == [("eng-a", True, 1), ("eng-a", False, 2)]
    assert c.holds(e) == frozenset(e.blocks)
    assert cp.stats.digest_bases_sent == 1
    # Following deltas on the same base go as they are.
    e.churn()
    publish(cp, e, full=False)
    settle(cp, [c])
    assert c.received[-1] == ("eng-a", False, 3) and len(c.received) == 3
    assert c.holds(e) == frozenset(e.blocks)


def test_a_full_digest_coalesced_away_is_sent_ahead_of_its_delta() -> None:
    cp = ControlPlane(eds=False)
    e = Engine("eng-a", random.Random(2))
    c = Client(cp, 0, ["eng-a"], delta=True)
    e.churn()
    publish(cp, e, full=True)
    settle(cp, [c])
    # A resync and a delta on it within one flush: the cache keeps only the delta.
    e.churn()
    publish(cp, e, full=True)
    e.churn()
    publish(cp, e, full=False)
    settle(cp, [c])
    assert [(f, s) for _, f, s in c.received] == [(True, 1), (True, 2), (False, 3)]
    assert c.holds(e) == frozenset(e.blocks)


def test_lockstep_members_get_the_base_and_a_slow_one_does_not_merge_it_away() -> None:
    cp = ControlPlane(eds=False)
    e = Engine("eng-a", random.Random(3))
    clients = [Client(cp, k, None, delta=True) for k in range(3)]
    e.churn()
    publish(cp, e, full=True)
    settle(cp, clients)
    assert all(c.sub.lockstep is not None for c in clients)
    slow, quick = clients[0], clients[1:]
    # The slow one leaves its last response unanswered while the rest keep up.
    e.churn()
    publish(cp, e, full=False)
    cp.flush()
    for c in clients:
        c.receive()
    for c in quick:
        c.ack()
    e.churn()
    publish(cp, e, full=True)
    e.churn()
    publish(cp, e, full=False)  # full + delta in one flush: the group never saw the full
    cp.flush()
    for c in quick:
        assert c.receive()
        c.ack()
    cp.flush()  # the delta follows its base
    for c in quick:
        assert c.receive()
        c.ack()
    assert len(slow.sub.backlog) == 2  # the base's batch and the delta's
    settle(cp, clients)
    for c in clients:
        assert c.holds(e) == frozenset(e.blocks), c.stream.peer
        assert c.received[-2:] == [("eng-a", True, 3), ("eng-a", False, 4)]


def test_a_delta_on_a_base_the_control_plane_never_saw_goes_as_it_is() -> None:
    cp = ControlPlane(eds=False)
    e = Engine("eng-a", random.Random(5))
    e.churn()
    e.digest(full=True)  # published before this control plane started
    e.churn()
    publish(cp, e, full=False)
    c = Client(cp, 0, ["eng-a"], delta=True)
    settle(cp, [c])
    assert c.received == [("eng-a", False, 2)]
    assert c.holds(e) is None  # ignored until the next full digest, as before
    e.churn()
    publish(cp, e, full=True)
    settle(cp, [c])
    assert c.holds(e) == frozenset(e.blocks)


def test_removed_and_restarted_engines_forget_their_base() -> None:
    cp = ControlPlane(eds=False)
    e = Engine("eng-a", random.Random(6))
    e.churn()
    publish(cp, e, full=True)
    cp.flush()
    assert len(cp._digest_bases) == 1
    cp.publish(T, {}, removed=("eng-a",))
    cp.flush()
    assert len(cp._digest_bases) == 0
    # A restarted engine's new epoch starts with a full digest: the late subscriber gets
    # that base, never the old epoch's.
    e.restart()
    e.churn()
    publish(cp, e, full=True)
    e.churn()
    publish(cp, e, full=False)
    c = Client(cp, 0, ["eng-a"], delta=True)
    settle(cp, [c])
    assert c.received == [("eng-a", True, 1), ("eng-a", False, 2)]
    assert c.blocks["eng-a"].epoch == "e2" and c.holds(e) == frozenset(e.blocks)


@pytest.mark.parametrize("seed", range(30))
def test_every_subscriber_ends_holding_what_each_engine_holds(seed: int) -> None:
    """Random publishes (fulls, deltas, restarts), subscribers joining at random times on
    every path, slow answers, flushes at random: once everything is answered, each
    subscriber's blocks are each engine's."""
    rng = random.Random(seed)
    cp = ControlPlane(eds=False)
    engines = [Engine(f"eng-{i}", rng) for i in range(3)]
    for e in engines:
        e.churn()
        publish(cp, e, full=True)
    clients: list[Client] = []
    for step in range(120):
        roll = rng.random()
        if roll < 0.45:
            e = rng.choice(engines)
            e.churn()
            if rng.random() < 0.05:
                e.restart()
                e.churn()
                publish(cp, e, full=True)
            else:
                publish(cp, e, full=rng.random() < 0.2)
        elif roll < 0.6 and len(clients) < 6:
            names = None if rng.random() < 0.5 else [e.name for e in engines]
            clients.append(Client(cp, step, names, delta=rng.random() < 0.75))
        elif roll < 0.8:
            cp.flush()
        else:
            for c in clients:
                if rng.random() < 0.6:
                    c.ack()
                    c.receive()
    settle(cp, clients)
    assert clients, "the seed made no subscriber"
    for c in clients:
        for e in engines:
            assert c.holds(e) == frozenset(e.blocks), (c.stream.peer, e.name)
