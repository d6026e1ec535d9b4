"""Admission's knee gate (filters/admission.py): past the pool's knee a new task waits in
meshd while a started task goes on; the held go newest first, one at a time, and are
refused after knee_max_wait_s."""

from __future__ import annotations

from filters.admission import ADMIT, Admission, AdmissionConfig, AdmissionItem, Queue, Reject
from filters.guard import GuardConfig, PoolGuard


class _Pool:
    """A stand-in for the router's pool_wait: the predicted queueing delay, seconds."""

    def __init__(self, wait: float | None = 0.0) -> None:
        self.wait = wait
        self.asked = 0

    def __call__(self, now: float, stop_below: float) -> float | None:
        self.asked += 1
        return self.wait


def _admission(pool: _Pool, **kw: float) -> Admission:
    cfg = AdmissionConfig(max_in_flight=100, knee_wait_s=1.0, knee_max_wait_s=5.0, **kw)
    return Admission(cfg, wait_source=pool)


def test_under_the_knee_everything_goes_at_once() -> None:
    pool = _Pool(0.5)
    a = _admission(pool)
    assert a.offer(AdmissionItem("new"), 0.0) is ADMIT
    assert a.offer(AdmissionItem("step", started=True), 0.0) is ADMIT


def test_past_the_knee_a_new_task_waits_and_a_started_one_goes() -> None:
    pool = _Pool(1.5)
    a = _admission(pool)
    held = a.offer(AdmissionItem("new", task_id="t-new"), 0.0)
    assert isinstance(held, Queue)
    assert a.offer(AdmissionItem("flagged", started=True), 0.0) is ADMIT
    # A task with a successful step is started too, without the flag.
    a.record_step("t-old")
    assert a.offer(AdmissionItem("sunk", task_id="t-old"), 0.0) is ADMIT
    assert a.knee_held == 1 and a.queued == 1
    # Still past the knee: nothing new goes, even with slots free.
    assert a.next(0.5) is None
    pool.wait = 0.2
    item = a.next(0.6)
    assert item is not None and item.id == "new"


def test_held_requests_go_newest_first_and_one_at_a_time() -> None:
    pool = _Pool(2.0)
    a = _admission(pool)
    for i, t in enumerate((0.0, 0.1, 0.2)):
        assert isinstance(a.offer(AdmissionItem(f"n{i}"), t), Queue)
    pool.wait = 0.0
    first = a.next(0.3)
    assert first is not None and first.id == "n2"  # adaptive LIFO
    # The router has not placed n2 yet: the next is not judged until it has.
    assert a.next(0.3) is None
    assert not a.routed("someone-else")
    assert a.routed("n2")
    second = a.next(0.3)
    assert second is not None and second.id == "n1"
    # A release (or the driver's tick) also opens the gate for the next.
    a.release("n1", 0.4)
    third = a.next(0.4)
    assert third is not None and third.id == "n0"


def test_a_tick_opens_the_gate_when_no_release_comes() -> None:
    pool = _Pool(2.0)
    a = _admission(pool)
    a.offer(AdmissionItem("a"), 0.0)
    a.offer(AdmissionItem("b"), 0.0)
    pool.wait = 0.0
    assert a.next(0.1) is not None
    assert a.next(0.1) is None
    assert a.expire(0.35) == []
    assert a.next(0.35) is not None


def test_a_request_held_past_knee_max_wait_is_refused_as_overload() -> None:
    pool = _Pool(3.0)
    a = _admission(pool)
    a.offer(AdmissionItem("late"), 0.0)
    a.offer(AdmissionItem("later"), 2.0)
    assert a.expire(4.9) == []
    (r,) = a.expire(5.0)
    assert isinstance(r, Reject) and r.item.id == "late" and r.reason == "overload"
    assert "knee_wait_s" in r.message and r.code == "overloaded"
    assert r.retry_after_s >= 1.0
    assert a.queued == 1
    (r2,) = a.expire(7.0)
    assert r2.item.id == "later"
    assert a.queued == 0


def test_an_admitted_request_requeued_is_never_refused_by_the_knee() -> None:
    pool = _Pool(3.0)
    a = _admission(pool)
    a.offer(AdmissionItem("held"), 0.0)
    pool.wait = 0.0
    assert a.next(0.1) is not None
    a.requeue("held", 0.2)  # every endpoint full after all: waits again, admitted
    pool.wait = 3.0
    assert a.expire(100.0) == []  # no deadline, and it was admitted: kept
    assert a.queued == 1


def test_the_gate_is_off_without_a_knee_or_a_source() -> None:
    for a in (
        Admission(AdmissionConfig(knee_wait_s=None), wait_source=_Pool(100.0)),
        Admission(AdmissionConfig(knee_wait_s=1.0)),
    ):
        assert a.offer(AdmissionItem("x"), 0.0) is ADMIT


def test_a_started_request_does_not_even_ask_the_router() -> None:
    pool = _Pool(5.0)
    a = _admission(pool)
    assert a.offer(AdmissionItem("s", started=True), 0.0) is ADMIT
    assert pool.asked == 0


def test_guard_wires_the_source_and_routed_pumps_the_next() -> None:
    pool = _Pool(2.0)
    guard = PoolGuard(
        GuardConfig(admission=AdmissionConfig(knee_wait_s=1.0), throttle=None),
        pool_wait=pool,
    )

    class _Rng:
        def random(self) -> float:
            return 0.5

    assert isinstance(guard.gate(AdmissionItem("a"), 0.0, _Rng()), Queue)
    assert isinstance(guard.gate(AdmissionItem("b"), 0.0, _Rng()), Queue)
    pool.wait = 0.0
    ev = guard.pump(0.1)
    assert [i.id for i in ev.dispatch] == ["b"]
    assert guard.routed("a", 0.1) is None  # not the one let through
    ev2 = guard.routed("b", 0.1)
    assert ev2 is not None and [i.id for i in ev2.dispatch] == ["a"]
    guard.step_succeeded("task")
    assert guard.admission is not None and guard.admission.has_sunk_cost("task")
