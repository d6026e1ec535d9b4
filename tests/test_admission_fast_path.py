"""Admission's fast path (offer with nothing queued and a slot free, in one frame) decides
as its general path does: the same decisions, refusals, counters and knee questions on
random sequences of offers, releases, requeues, cancels, ticks and steps; plus the cheap
value types on the way to the upstream send (AdmissionItem built by admission_item,
Screened) read as their fields say."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from filters.admission import Admission, AdmissionConfig, AdmissionItem, TenantPolicy
from filters.guard import GuardConfig, PoolGuard
from filters.picker import PickRequest
from filters.pool_router import admission_item


class _GeneralPath(Admission):
    """Every offer by the general path (the reference for the fast one)."""

    def offer(self, item: AdmissionItem, now: float) -> Any:
        if item.id in self._queued or item.id in self._in_flight:
            raise ValueError(f"item {item.id!r} is already queued or in flight")
        return self._offer(item, now, None)


def _decision(d: Any) -> tuple[Any, ...]:
    kind = type(d).__name__
    if kind == "Queue":
        return (kind, d.position, d.expected_wait_s)
    if kind == "Reject":
        return (kind, d.item, d.reason, d.message, d.retry_after_s)
    return (kind,)


_items: st.SearchStrategy[dict[str, Any]] = st.builds(
    dict,
    tenant=st.sampled_from([None, "a", "b", "c"]),
    priority=st.sampled_from([None, -1, 0, 3, 5, 9, 12]),
    deadline=st.sampled_from([None, -0.1, 0.05, 0.5, 5.0]),  # from now
    predicted_ttft_s=st.sampled_from([0.0, 0.2]),
    cost=st.sampled_from([1.0, 10.0]),
    task_id=st.sampled_from([None, "t1", "t2"]),
    started=st.sampled_from([False, False, True]),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("offer"), _items),
        st.tuples(
            st.sampled_from(["release", "release", "requeue", "cancel", "routed"]),
            st.integers(1, 8),
        ),
        st.tuples(st.sampled_from(["next", "next", "expire", "take"]), st.just(0)),
        st.tuples(st.just("step"), st.sampled_from(["t1", "t2"])),
        st.tuples(st.just("capacity"), st.integers(1, 4)),
    ),
    max_size=60,
)


def _run(cls: type[Admission], config: AdmissionConfig, waits: list[float | None], ops: list[Any],
         gaps: list[float]) -> list[Any]:  # fmt: skip
    asked: list[tuple[float, float]] = []

    def wait_source(now: float, stop_below: float) -> float | None:
        asked.append((now, stop_below))
        return waits[len(asked) % len(waits)]

    a = cls(config, wait_source=wait_source)
    out: list[Any] = []
    now, ids = 0.0, 0
    for i, (op, arg) in enumerate(ops):
        now += gaps[i % len(gaps)]
        try:
            if op == "offer":
                ids += 1
                fields = dict(arg)
                if fields["deadline"] is not None:
                    fields["deadline"] += now
                out.append(_decision(a.offer(AdmissionItem(ids, **fields), now)))
            elif op == "release":
                a.release(arg, now)
            elif op == "requeue":
                a.requeue(arg, now)
            elif op == "cancel":
                out.append(a.cancel(arg))
            elif op == "routed":
                out.append(a.routed(arg))
            elif op == "next":
                item = a.next(now)
                out.append(None if item is None else item.id)
            elif op == "expire":
                out.append([_decision(r) for r in a.expire(now)])
            elif op == "take":
                out.append([_decision(r) for r in a.take_rejected()])
            elif op == "step":
                a.record_step(arg)
            else:
                a.set_capacity(arg)
        except (KeyError, ValueError) as exc:
            out.append(type(exc).__name__)
        out.append((a.in_flight, a.queued, a.admitted, a.queued_total, a.dispatched))
        out.append((dict(a.rejected), a.cancelled, a.shed, a.knee_held, len(asked)))
        # What a requeue would restore: the band, order and deadline each admitted item got.
        out.append(sorted((k, d[:6]) for k, d in a._in_flight.items()))
    return out


@settings(max_examples=200, deadline=None)
@given(
    ops=_ops,
    slots=st.integers(1, 4),
    max_queued=st.integers(0, 6),
    per_tenant=st.integers(0, 4),
    a_cap=st.sampled_from([None, 1, 2]),
    b_max_priority=st.integers(0, 9),
    knee=st.sampled_from([None, 0.5, 0.5]),
    residence=st.sampled_from([None, 0.2]),
    waits=st.lists(st.sampled_from([None, 0.1, 1.0, 3.0]), min_size=1, max_size=4),
    gaps=st.lists(st.sampled_from([0.0, 0.01, 0.3]), min_size=1, max_size=4),
)
def test_the_fast_path_decides_as_the_general_path(
    ops: list[Any],
    slots: int,
    max_queued: int,
    per_tenant: int,
    a_cap: int | None,
    b_max_priority: int,
    knee: float | None,
    residence: float | None,
    waits: list[float | None],
    gaps: list[float],
) -> None:
    config = AdmissionConfig(
        max_in_flight=slots,
        max_queued=max_queued,
        max_queued_per_tenant=per_tenant,
        tenants={
            "a": TenantPolicy(weight=2.0, max_in_flight=a_cap),
            "b": TenantPolicy(max_priority=b_max_priority),
        },
        knee_wait_s=knee,
        knee_max_wait_s=0.3,
        initial_residence_s=residence,
    )
    fast = _run(Admission, config, waits, ops, gaps)
    assert fast == _run(_GeneralPath, config, waits, ops, gaps)


def test_admission_item_fills_the_fields_by_name() -> None:
    """admission_item builds its AdmissionItem with tuple.__new__ (positional): the same
    item as the keyword constructor."""
    pick = PickRequest(model="m", tenant="t", priority=7, deadline_s=12.5, context_key="w")
    item = admission_item("id", None, pick, 2, 0, 1.0)
    assert type(item) is AdmissionItem
    assert item == AdmissionItem(
        "id", tenant="t", priority=7, deadline=12.5, cost=1.0, task_id="w", started=True
    )
    assert admission_item("id", None, pick, None, 300, 1.0).cost == 300.0


def test_screened_reads_by_name_and_stops_at_the_limit() -> None:
    class R:
        def __init__(self, url: str) -> None:
            self.url = url

    guard = PoolGuard(GuardConfig(throttle=None, admission=None), ["a", "b", "c"])
    routes = [R("a"), R("b"), R("c")]
    s = guard.screen(routes, 10, None, 0.0)
    assert (s.routes, s.skipped, s.full) == (routes, [], False)
    one = guard.screen(routes, 10, None, 0.0, limit=1)
    assert (one.routes, one.skipped, one.full) == (routes[:1], [], False)
    ids: list[Hashable] = [r.url for r in guard.screen(routes, 10, None, 0.0, limit=2).routes]
    assert ids == ["a", "b"]
