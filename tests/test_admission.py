"""Admission (filters/admission.py) on a virtual clock: EDF order, priority bands, sunk
cost, fair shares converging to weights, deadline/quota/overload refusals, and the
property that nothing admitted is ever dropped silently."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.admission import (
    ADMIT,
    Admission,
    AdmissionConfig,
    AdmissionItem,
    Queue,
    Reject,
    TenantPolicy,
)


def _full(config: AdmissionConfig | None = None) -> Admission:
    """An admission with its one slot taken, so offers queue."""
    a = Admission(config or AdmissionConfig(max_in_flight=1))
    assert a.offer(AdmissionItem("busy"), 0.0) is ADMIT
    return a


def _drain(a: Admission, now: float, last: Hashable = "busy") -> list[Hashable]:
    order = []
    a.release(last, now)
    while (it := a.next(now)) is not None:
        order.append(it.id)
        a.release(it.id, now)
    return order


def test_admits_while_slots_are_free_then_queues() -> None:
    a = Admission(AdmissionConfig(max_in_flight=2))
    assert a.offer(AdmissionItem(1), 0.0) is ADMIT
    assert a.offer(AdmissionItem(2), 0.0) is ADMIT
    q = a.offer(AdmissionItem(3), 0.0)
    assert isinstance(q, Queue) and q.position == 0
    assert a.next(0.0) is None  # no free slot
    a.release(1, 1.0)
    item = a.next(1.0)
    assert item is not None and item.id == 3
    assert (a.in_flight, a.queued, a.admitted, a.dispatched) == (2, 0, 2, 1)


def test_earliest_deadline_first_within_a_tenant() -> None:
    a = _full()
    for name, deadline in (("c", 30.0), ("none", None), ("a", 10.0), ("b", 20.0)):
        a.offer(AdmissionItem(name, deadline=deadline), 0.0)
    assert _drain(a, 0.0) == ["a", "b", "c", "none"]


def test_higher_priority_goes_first_regardless_of_arrival() -> None:
    a = _full()
    a.offer(AdmissionItem("low", priority=1), 0.0)
    a.offer(AdmissionItem("std", priority=5), 0.0)
    a.offer(AdmissionItem("crit", priority=9, tenant="other"), 0.0)
    assert _drain(a, 0.0) == ["crit", "std", "low"]


def test_a_task_with_sunk_cost_goes_before_a_new_task_of_equal_priority() -> None:
    a = _full()
    a.task_progress("t-old", spent_usd=0.42, steps_ok=2)
    a.offer(AdmissionItem("new-task", priority=5, task_id="t-new"), 0.0)
    a.offer(AdmissionItem("step-3", priority=5, task_id="t-old"), 0.0)
    a.offer(AdmissionItem("higher", priority=6, task_id="t-new2"), 0.0)
    assert _drain(a, 0.0) == ["higher", "step-3", "new-task"]
    assert a.has_sunk_cost("t-old") and not a.has_sunk_cost("t-new")


def test_sunk_cost_thresholds_and_bounded_task_memory() -> None:
    a = Admission(AdmissionConfig(sunk_cost_min_steps=2, sunk_cost_min_usd=0.1, max_tasks=2))
    a.task_progress("one-step", 1.0, 1)
    a.task_progress("cheap", 0.01, 5)
    a.task_progress("real", 0.5, 3)
    assert not a.has_sunk_cost("cheap") and a.has_sunk_cost("real")
    assert not a.has_sunk_cost("one-step")  # evicted (LRU of 2) and below threshold anyway
    a.task_progress("x", 1.0, 9)
    a.task_progress("y", 1.0, 9)
    assert not a.has_sunk_cost("real")  # evicted
    a.record_step("z", 0.05)
    assert not a.has_sunk_cost("z")  # one step, $0.05: under both thresholds
    a.record_step("z", 0.05)
    assert a.has_sunk_cost("z")


@pytest.mark.parametrize(
    ("wa", "wb", "cost_a", "cost_b"), [(3.0, 1.0, 1.0, 1.0), (1.0, 1.0, 4.0, 1.0)]
)
def test_fair_shares_converge_to_the_weights(
    wa: float, wb: float, cost_a: float, cost_b: float
) -> None:
    cfg = AdmissionConfig(
        max_in_flight=1,
        max_queued=10_000,
        max_queued_per_tenant=10_000,
        tenants={"A": TenantPolicy(weight=wa), "B": TenantPolicy(weight=wb)},
    )
    a = _full(cfg)
    for i in range(3000):
        a.offer(AdmissionItem(("A", i), tenant="A", cost=cost_a), 0.0)
        a.offer(AdmissionItem(("B", i), tenant="B", cost=cost_b), 0.0)
    served: Counter[str] = Counter()
    last: Hashable = "busy"
    for _ in range(2000):
        a.release(last, 0.0)
        item = a.next(0.0)
        assert item is not None
        served[str(item.tenant)] += int(item.cost)
        last = item.id
    share_a = served["A"] / (served["A"] + served["B"])
    assert share_a == pytest.approx(wa / (wa + wb), abs=0.01)


def test_an_idle_tenant_does_not_bank_credit() -> None:
    cfg = AdmissionConfig(max_in_flight=1, max_queued=1000, max_queued_per_tenant=1000)
    a = _full(cfg)
    for i in range(100):
        a.offer(AdmissionItem(("A", i), tenant="A"), 0.0)
    order = []
    last: Hashable = "busy"
    for _ in range(50):
        a.release(last, 0.0)
        it = a.next(0.0)
        assert it is not None
        order.append(it.tenant)
        last = it.id
    for i in range(10):  # B arrives late: it shares from now on, no catch-up burst
        a.offer(AdmissionItem(("B", i), tenant="B"), 0.0)
    for _ in range(10):
        a.release(last, 0.0)
        it = a.next(0.0)
        assert it is not None
        order.append(it.tenant)
        last = it.id
    assert Counter(order[50:]) == {"A": 5, "B": 5}


def test_a_deadline_already_out_of_reach_is_refused_at_once() -> None:
    a = Admission()
    r = a.offer(AdmissionItem("x", deadline=10.5, predicted_ttft_s=1.0), 10.0)
    assert isinstance(r, Reject) and r.reason == "deadline" and r.code == "deadline_unmeetable"
    assert r.retry_after_s >= 1.0 and "deadline" in r.message
    assert a.offer(AdmissionItem("y", deadline=11.5, predicted_ttft_s=1.0), 10.0) is ADMIT


def _with_residence(a: Admission, seconds: float) -> None:
    assert a.offer(AdmissionItem("warm"), 0.0) is ADMIT
    a.release("warm", seconds)


def test_predicted_lateness_is_refused_early() -> None:
    a = Admission(AdmissionConfig(max_in_flight=1))
    _with_residence(a, 1.0)  # each request holds a slot about 1 s
    a.offer(AdmissionItem("busy"), 1.0)
    for i in range(10):
        assert isinstance(a.offer(AdmissionItem(("hi", i), priority=8), 1.0), Queue)
    r = a.offer(AdmissionItem("late", priority=2, deadline=4.0), 1.0)
    assert isinstance(r, Reject) and r.reason == "deadline"
    assert "10 higher-priority" in r.message
    assert r.retry_after_s == pytest.approx(10.0)
    assert isinstance(a.offer(AdmissionItem("patient", priority=2, deadline=30.0), 1.0), Queue)


def test_queued_items_that_become_late_are_refused_lowest_priority_first() -> None:
    a = Admission(AdmissionConfig(max_in_flight=1))
    _with_residence(a, 1.0)
    a.offer(AdmissionItem("busy"), 1.0)
    a.offer(AdmissionItem("p7", priority=7, deadline=3.0), 1.0)
    a.offer(AdmissionItem("p2", priority=2, deadline=3.0), 1.0)
    a.offer(AdmissionItem("p5", priority=5, deadline=3.0), 1.0)
    a.offer(AdmissionItem("p5-ok", priority=5, deadline=100.0), 1.0)
    rejected = a.expire(3.5)  # all three deadlines passed while busy held the slot
    assert [r.item.id for r in rejected] == ["p2", "p5", "p7"]
    assert all(r.reason == "deadline" for r in rejected)
    assert _drain(a, 3.5) == ["p5-ok"]


def test_next_refuses_what_it_finds_late_on_the_way() -> None:
    a = _full()
    a.offer(AdmissionItem("late", deadline=2.0), 0.0)
    a.offer(AdmissionItem("fine", deadline=50.0), 0.0)
    a.release("busy", 5.0)
    item = a.next(5.0)
    assert item is not None and item.id == "fine"
    assert [r.item.id for r in a.take_rejected()] == ["late"]
    assert a.take_rejected() == []


def test_tenant_queue_quota() -> None:
    cfg = AdmissionConfig(max_in_flight=1, tenants={"small": TenantPolicy(max_queued=2)})
    a = _full(cfg)
    a.offer(AdmissionItem(1, tenant="small"), 0.0)
    a.offer(AdmissionItem(2, tenant="small"), 0.0)
    r = a.offer(AdmissionItem(3, tenant="small"), 0.0)
    assert isinstance(r, Reject) and r.reason == "quota" and r.code == "tenant_quota_exceeded"
    assert "'small'" in r.message
    assert isinstance(a.offer(AdmissionItem(4, tenant="big"), 0.0), Queue)


def test_a_full_queue_sheds_the_newest_lowest_priority_item_for_higher_work() -> None:
    a = _full(AdmissionConfig(max_in_flight=1, max_queued=3))
    for i in range(3):
        assert isinstance(a.offer(AdmissionItem(f"low{i}", priority=3), 0.0), Queue)
    r = a.offer(AdmissionItem("low3", priority=3), 0.0)
    assert isinstance(r, Reject) and r.reason == "overload" and r.code == "overloaded"
    assert isinstance(a.offer(AdmissionItem("high", priority=7), 0.0), Queue)
    (shed,) = a.take_rejected()
    assert shed.item.id == "low2" and shed.reason == "overload" and a.shed == 1
    assert _drain(a, 0.0) == ["high", "low0", "low1"]


def test_tenant_priority_ceiling() -> None:
    cfg = AdmissionConfig(max_in_flight=1, tenants={"batch": TenantPolicy(max_priority=3)})
    a = _full(cfg)
    a.offer(AdmissionItem("claims-critical", tenant="batch", priority=9), 0.0)
    a.offer(AdmissionItem("standard", priority=5), 0.0)
    assert _drain(a, 0.0) == ["standard", "claims-critical"]


def test_tenant_in_flight_cap_lets_others_through() -> None:
    cfg = AdmissionConfig(max_in_flight=4, tenants={"A": TenantPolicy(max_in_flight=1)})
    a = Admission(cfg)
    assert a.offer(AdmissionItem("a1", tenant="A"), 0.0) is ADMIT
    assert isinstance(a.offer(AdmissionItem("a2", tenant="A"), 0.0), Queue)
    assert a.next(0.0) is None  # slots free, but A is at its cap
    assert isinstance(a.offer(AdmissionItem("b1", tenant="B"), 0.0), Queue)  # behind a2
    item = a.next(0.0)
    assert item is not None and item.id == "b1"
    a.release("a1", 1.0)
    item = a.next(1.0)
    assert item is not None and item.id == "a2"


def test_requeue_blocks_until_a_release_and_keeps_the_item() -> None:
    a = Admission(AdmissionConfig(max_in_flight=2, max_queued=1))
    assert a.offer(AdmissionItem("x", deadline=50.0), 0.0) is ADMIT
    assert a.offer(AdmissionItem("y"), 0.0) is ADMIT
    a.offer(AdmissionItem("z"), 0.0)
    a.requeue("x", 0.1)  # the pool said "queue" after all; may exceed max_queued
    assert a.queued == 2 and a.in_flight == 1
    assert a.next(0.1) is None  # blocked
    a.release("y", 0.15)
    item = a.next(0.15)
    assert item is not None and item.id == "x"  # earliest deadline
    a.requeue("x", 1.0)
    assert a.next(1.05) is None
    item = a.next(1.1)  # nothing released: the block ends after requeue_backoff_s
    assert item is not None and item.id == "x"
    with pytest.raises(KeyError):
        a.requeue("nope", 1.0)


def test_cancel_and_duplicates() -> None:
    a = _full()
    a.offer(AdmissionItem("q"), 0.0)
    with pytest.raises(ValueError):
        a.offer(AdmissionItem("q"), 0.0)
    assert a.cancel("q") and not a.cancel("q") and not a.cancel("busy")
    assert a.queued == 0 and a.cancelled == 1


def test_retry_after_is_bounded() -> None:
    a = Admission(AdmissionConfig(max_in_flight=1, max_queued=1, max_retry_after_s=5.0))
    _with_residence(a, 100.0)
    a.offer(AdmissionItem("busy"), 100.0)
    a.offer(AdmissionItem("q"), 100.0)
    r = a.offer(AdmissionItem("r"), 100.0)
    assert isinstance(r, Reject) and r.retry_after_s == 5.0


# -- nothing is dropped silently ---------------------------------------------------------

_offer = st.tuples(
    st.just("offer"),
    st.sampled_from(["A", "B", "C", None]),
    st.integers(0, 9),
    st.one_of(st.none(), st.floats(0.0, 5.0)),
    st.sampled_from([None, "t1", "t2"]),
)
# Offers dominate so that the queue fills: shedding and quota paths get exercised.
_op = st.one_of(
    _offer,
    _offer,
    _offer,
    _offer,
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("next")),
    st.tuples(st.just("advance"), st.floats(0.0, 2.0)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("requeue"), st.integers(0, 50)),
    st.tuples(st.just("progress"), st.sampled_from(["t1", "t2"])),
    st.tuples(st.just("capacity"), st.integers(1, 4)),
    # The pool's predicted wait (the knee gate's source) and the router placing an item.
    st.tuples(st.just("wait"), st.sampled_from([None, 0.0, 0.5, 3.0])),
    st.tuples(st.just("routed"), st.integers(0, 50)),
)


@pytest.mark.parametrize("knee", [False, True])
@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, min_size=30, max_size=150))
def test_every_item_is_answered_exactly_once(knee: bool, ops: list[tuple[Any, ...]]) -> None:
    cfg = AdmissionConfig(
        max_in_flight=2,
        max_queued=4,
        max_queued_per_tenant=3,
        tenants={"A": TenantPolicy(weight=2.0, max_in_flight=1), "C": TenantPolicy(max_priority=4)},
        knee_wait_s=1.0 if knee else None,
        knee_max_wait_s=1.5,
    )
    wait: list[float | None] = [0.0]
    a = Admission(cfg, wait_source=lambda now, knee: wait[0])
    now = 0.0
    fate: dict[int, list[str]] = {}
    running: list[int] = []
    offered = 0

    def settle(rejections: list[Reject]) -> None:
        for r in rejections:
            assert isinstance(r.item.id, int)
            fate[r.item.id].append(f"rejected:{r.reason}")
            assert r.message and r.retry_after_s >= cfg.min_retry_after_s

    def pump() -> None:
        while (it := a.next(now)) is not None:
            assert isinstance(it.id, int)
            fate[it.id].append("dispatched")
            running.append(it.id)
        settle(a.take_rejected())

    for op in ops:
        kind = op[0]
        if kind == "offer":
            _, tenant, prio, rel_deadline, task = op
            i = offered
            offered += 1
            fate[i] = []
            deadline = None if rel_deadline is None else now + rel_deadline
            started = i % 3 == 0
            d = a.offer(AdmissionItem(i, tenant, prio, deadline, 0.1, 1.0, task, started), now)
            if d is ADMIT:
                fate[i].append("admitted")
                running.append(i)
            elif isinstance(d, Reject):
                fate[i].append(f"rejected:{d.reason}")
            settle(a.take_rejected())
        elif kind == "release" and running:
            i = running.pop(op[1] % len(running))
            a.release(i, now)
            pump()
        elif kind == "next":
            pump()
        elif kind == "advance":
            now += op[1]
            settle(a.expire(now))
        elif kind == "cancel" and offered:
            i = op[1] % offered
            if a.cancel(i):
                fate[i].append("cancelled")
        elif kind == "requeue" and running:
            i = running.pop(op[1] % len(running))
            a.requeue(i, now)
            fate[i].pop()  # its dispatch is undone: it is waiting again
        elif kind == "progress":
            a.task_progress(op[1], 1.0, 2)
        elif kind == "capacity":
            a.set_capacity(op[1])
        elif kind == "wait":
            wait[0] = op[1]
        elif kind == "routed" and running and a.routed(running[op[1] % len(running)]):
            pump()
        assert a.in_flight == len(running)
        assert a.queued <= cfg.max_queued + sum(1 for o in ops if o[0] == "requeue")
    # Drain: finish everything in flight, pumping as a driver's timer would.
    wait[0] = 0.0  # nothing in flight: the pool has drained
    for _ in range(offered + 2):
        now += 1.0
        while running:
            a.release(running.pop(), now)
        settle(a.expire(now))
        pump()
    assert a.queued == 0 and a.in_flight == 0
    for i, f in fate.items():
        assert len(f) == 1, (i, f)  # exactly one answer each
