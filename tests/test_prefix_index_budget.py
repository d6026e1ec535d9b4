"""PrefixIndex's expiry a budget at a time: whatever is left behind, every answer (matches,
stores, holdings, counts) equals that of an index that finishes every expiry at once."""

from __future__ import annotations

import heapq
import signal
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import filters.prefix_index as prefix_index
from filters.prefix_index import PrefixIndex
from tests.test_prefix_index import chain

EAGER = 1 << 40  # a budget no test exhausts: every query finishes its expiry

PROMPTS = st.lists(st.integers(0, 3), min_size=1, max_size=12)
NAMES = st.sampled_from(["e0", "e1", "e2"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("record"), NAMES, PROMPTS, st.floats(0, 4)),
        # Refreshes of one chain: each leaves stale heap items, which the budget works off.
        st.tuples(st.just("burst"), NAMES, PROMPTS, st.integers(2, 40), st.floats(0, 4)),
        st.tuples(st.just("ack"), NAMES),
        st.tuples(st.just("store"), NAMES, PROMPTS, st.integers(0, 11)),
        st.tuples(st.just("remove"), NAMES, PROMPTS, st.integers(0, 11)),
        st.tuples(st.just("truncate"), NAMES, PROMPTS, st.integers(0, 12)),
        st.tuples(st.just("match"), PROMPTS, st.floats(0, 12)),
        st.tuples(st.just("clear"), NAMES),
        st.tuples(st.just("cap"), NAMES, st.integers(0, 20)),
        st.tuples(st.just("forget"), NAMES),
        st.tuples(st.just("epoch"), NAMES, st.integers(0, 2)),
    ),
    max_size=60,
)


def _apply(idx: PrefixIndex, op: tuple[object, ...], now: float) -> object:
    kind = op[0]
    if kind == "record":
        idx.record(op[1], chain(op[2]), now)  # type: ignore[arg-type]
    elif kind == "burst":
        for _ in range(op[3]):  # type: ignore[call-overload]
            idx.record(op[1], chain(op[2]), now)  # type: ignore[arg-type]
    elif kind == "ack":
        since = idx.expecting_since(op[1])  # type: ignore[arg-type]
        idx.acknowledge(op[1])  # type: ignore[arg-type]
        return since
    elif kind == "store":
        hashes = chain(op[2])  # type: ignore[arg-type]
        k = op[3]
        assert isinstance(k, int)
        if k < len(hashes):  # the blocks after hashes[k], following it as the parent
            return idx.store(op[1], hashes[k + 1 :], now, parent=hashes[k])  # type: ignore[arg-type]
        return idx.store(op[1], hashes, now)  # type: ignore[arg-type]
    elif kind == "remove":
        hashes = chain(op[2])  # type: ignore[arg-type]
        k = op[3]
        assert isinstance(k, int)
        idx.remove(op[1], hashes[k : k + 2], now)  # type: ignore[arg-type]
    elif kind == "truncate":
        idx.truncate(op[1], chain(op[2]), op[3])  # type: ignore[arg-type]
    elif kind == "match":
        return idx.match_detail(chain(op[1]), now)  # type: ignore[arg-type]
    elif kind == "clear":
        idx.clear(op[1])  # type: ignore[arg-type]
    elif kind == "cap":
        idx.set_capacity(op[1], op[2])  # type: ignore[arg-type]
    elif kind == "forget":
        idx.forget(op[1])  # type: ignore[arg-type]
    else:
        return idx.observe_epoch(op[1], op[2])  # type: ignore[arg-type]
    return None


@settings(max_examples=300, deadline=None)
@given(ops=OPS, ttl=st.sampled_from([0.5, 3.0, 10.0]), budget=st.integers(1, 3))
def test_a_budgeted_index_answers_as_one_that_expires_at_once(ops, ttl, budget):
    lazy = PrefixIndex(
        default_capacity_blocks=16, ttl_s=ttl, track_blocks=True, expire_budget=budget
    )
    eager = PrefixIndex(
        default_capacity_blocks=16, ttl_s=ttl, track_blocks=True, expire_budget=EAGER
    )
    now = 0.0
    for op in ops:
        if op[0] in ("record", "burst", "match"):
            dt = op[-1]
            assert isinstance(dt, float)
            now += dt
        assert _apply(lazy, op, now) == _apply(eager, op, now), op
        lazy.check()
        assert eager._behind == 0
    for name in ("e0", "e1", "e2"):
        assert lazy.expecting_since(name) == eager.expecting_since(name)
        assert lazy.held(name) == eager.held(name)
        assert lazy.used_blocks(name) == eager.used_blocks(name)
    lazy.check()


def _backlog(budget: int) -> tuple[PrefixIndex, list[int], list[int]]:
    """One endpoint that recorded chain a and dropped it 499 times (499 dead heap items),
    then recorded a (at 0.499) and b beside it."""
    idx = PrefixIndex(ttl_s=10.0, expire_budget=budget)
    a = chain([1, 2, 3])
    b = chain([7, 8])
    for k in range(499):
        idx.record("e", a, k * 0.001)
        idx.truncate("e", a, 0)
    idx.record("e", a, 0.499)
    idx.record("e", b, 1.0)
    return idx, a, b


def test_a_query_examines_at_most_the_budget_and_ignores_what_it_left_behind():
    idx, a, b = _backlog(8)
    h = idx._holders["e"]
    items = len(h.heap)
    assert idx.match(a, 10.7) == {}  # a was last touched at 0.499: past the TTL at 10.499
    assert items - len(h.heap) <= 8  # ...but its entry is still there, behind
    assert h.bit & idx._behind
    assert any(at <= 0.5 for _, at, _ in h.entries.values())
    assert idx.match(b, 10.7) == {"e": 2}  # b (touched at 1.0) is alive
    assert idx.used_blocks("e") == 2  # a count finishes the holder's expiry first
    assert not h.bit & idx._behind
    idx.check()


def test_a_record_on_a_holder_behind_sees_its_expired_path_as_gone():
    idx, a, _ = _backlog(8)
    eager, _, _ = _backlog(EAGER)
    for ix in (idx, eager):
        ix.match(a[:1], 10.7)
        ix.acknowledge("e")  # the engine's events are alive: nothing unconfirmed
        ix.record("e", a[:2], 10.7)  # a[:2] is new again: a[2] must not come back with it
    assert idx._holders["e"].bit & idx._behind  # only the path was dropped
    assert idx.match(a, 10.8) == eager.match(a, 10.8) == {"e": 2}
    # New blocks, not a refresh of expired ones: the engine should confirm them.
    assert idx.expecting_since("e") == eager.expecting_since("e") == 10.7
    assert idx.used_blocks("e") == eager.used_blocks("e") == 4
    idx.check()


def test_steady_traffic_keeps_up_within_the_budget():
    idx = PrefixIndex(ttl_s=10.0)
    docs = [chain(range(d * 100, d * 100 + 50)) for d in range(8)]
    for k in range(4000):  # 200 s of traffic at 20 records/s over 16 endpoints
        now = k * 0.05
        idx.record(f"e{k % 16}", docs[k % 8][: 10 + k % 40], now)
        idx.match(docs[(k * 3) % 8], now)
        assert len(idx._pending) <= 16
    assert idx._behind == 0  # the default budget is far above steady traffic's need


def test_expire_budget_must_be_positive():
    with pytest.raises(ValueError):
        PrefixIndex(expire_budget=0)
    PrefixIndex(expire_budget=1)


@pytest.fixture
def alarm() -> Iterator[None]:
    def boom(signum: int, frame: object) -> None:
        raise TimeoutError("the index looped")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(5)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_due_time_and_horizon_agree_when_rounding_differs(alarm):
    # 60.39 + 120 == 180.39, yet 180.39 - 120 < 60.39: the index once compared an entry's
    # time with now - ttl but queued its holder at time + ttl, so at 180.39 the holder was
    # due, its entry was not, and expire() re-queued it at the same time forever.
    assert 60.39 + 120.0 <= 180.39 and 60.39 > 180.39 - 120.0
    idx = PrefixIndex(ttl_s=120.0)
    a = chain([1, 2, 3])
    idx.record("e", a, 60.39)
    assert idx.match(a, 180.38) == {"e": 3}
    assert idx.match(a, 180.39) == {}
    assert idx.used_blocks("e") == 0


def test_rebuilt_heaps_are_freed_a_step_at_a_time(monkeypatch):
    monkeypatch.setattr(prefix_index, "TRASH_STEP", 100)
    idx = PrefixIndex(ttl_s=1e9)
    a = chain([1, 2, 3])
    for _ in range(5000):  # drops pile up dead items until a rebuild
        idx.record("e", a, 0.0)
        if idx._trash:
            break
        idx.truncate("e", a, 0)
    old = sum(len(t) for t in idx._trash)
    assert old > 800  # 1,025 dead items, less the first step freed by the same record
    idx.record("e", a, 0.0)
    assert sum(len(t) for t in idx._trash) == old - 100
    h = idx._holders["e"]
    assert len(h.heap) + len(h.pheap) <= 8 * len(h.entries) + 1024
    assert all(item[3] in h.entries for item in heapq.nsmallest(1, h.heap))
    idx.check()


def test_refreshes_keep_about_one_heap_item_per_entry():
    idx = PrefixIndex(default_capacity_blocks=64)
    docs = [chain(range(d * 10, d * 10 + 20)) for d in range(3)]
    for k in range(3000):  # hot chains re-recorded: each refresh used to push an item
        idx.record("e", docs[k % 3], k * 0.01)
    h = idx._holders["e"]
    assert len(h.heap) <= 2 * len(h.entries) + 8
    assert not idx._trash  # so nothing needed rebuilding
    idx.set_capacity("e", 30)  # eviction still takes the oldest, tail first
    assert idx.held("e") == set(docs[2]) | set(docs[1][:10])
    idx.check()


def test_a_late_caller_sees_the_horizon_of_the_index_clock():
    """A match whose `now` is older than a time the index has seen still ignores what
    expired by then (the eager index once counted it until a query reached its due time)."""
    idx = PrefixIndex(ttl_s=10.0)
    a = chain([1, 2])
    idx.record("e", a, 0.0)
    idx.record("f", chain([3]), 20.0)  # the clock is at 20: a (touched at 0) expired at 10
    assert idx.match(a, 5.0) == {}
    assert idx.used_blocks("e") == 0
