"""PickerRouter.kv_capacities keeps its answer while no endpoint's capacity can have
changed (the admission tick asks 4 times a second; walking 1,000 endpoints each time was
most of the tick): the same dict until `kv_version` moves or a report behind it goes
stale. Whatever the order of reports, removals, TTLs and clock, it equals the walk."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from filters.endpoint_state import ReportedState
from filters.pool_router import EndpointSpec, PickerRouter

URLS = ["http://e0:1", "http://e1:1", "http://e2:1"]


def router() -> PickerRouter:
    # e0 configured with a capacity (a stale report falls back to it), e1 and e2 without.
    return PickerRouter(
        [
            EndpointSpec(URLS[0], kv_capacity_tokens=1000),
            EndpointSpec(URLS[1]),
            EndpointSpec(URLS[2]),
        ]
    )


def kv(blocks: int | None, block_size: int | None = 16) -> ReportedState:
    return ReportedState(kv_block_size=block_size, kv_capacity_blocks=blocks)


def walk(r: PickerRouter, now: float) -> dict[str, int]:
    """What kv_capacities answered before it kept its answer."""
    return {s.url: cap for s in r.states if (cap := s.kv_capacity(now))}


def test_the_same_answer_while_reports_renew_the_same_capacity() -> None:
    r = router()
    r.report(URLS[1], kv(100), 0.0, ttl_s=10.0)
    first = r.kv_capacities(1.0)
    assert first == {URLS[0]: 1000, URLS[1]: 1600}
    version = r.kv_version
    for t in range(2, 9):
        r.report(URLS[1], kv(100), float(t), ttl_s=10.0)  # the load moved, not the capacity
        assert r.kv_capacities(t + 0.5) is first
    assert r.kv_version == version


def test_a_new_capacity_a_removal_and_a_stale_report_are_seen() -> None:
    r = router()
    r.report(URLS[0], kv(200), 0.0, ttl_s=5.0)
    r.report(URLS[1], kv(100), 0.0, ttl_s=10.0)
    assert r.kv_capacities(1.0) == {URLS[0]: 3200, URLS[1]: 1600}
    r.report(URLS[1], kv(300), 2.0, ttl_s=10.0)
    assert r.kv_capacities(2.0) == {URLS[0]: 3200, URLS[1]: 4800}
    # e0's report goes stale at 5.0: back to its configured capacity, no report needed.
    assert r.kv_capacities(4.9) == {URLS[0]: 3200, URLS[1]: 4800}
    assert r.kv_capacities(5.0) == {URLS[0]: 1000, URLS[1]: 4800}
    # Fresh again with the capacity it had: reported again.
    r.report(URLS[0], kv(200), 6.0, ttl_s=5.0)
    assert r.kv_capacities(6.0) == {URLS[0]: 3200, URLS[1]: 4800}
    r.report(URLS[1], None, 7.0, ttl_s=10.0)
    assert r.kv_capacities(7.0) == {URLS[0]: 3200}


def test_an_earlier_clock_is_answered_afresh() -> None:
    r = router()
    r.report(URLS[2], kv(10), 0.0, ttl_s=1.0)
    assert r.kv_capacities(2.0) == {URLS[0]: 1000}  # stale by then
    assert r.kv_capacities(0.5) == {URLS[0]: 1000, URLS[2]: 160}  # fresh at 0.5


_ops = st.lists(
    st.tuples(
        st.sampled_from(["report", "forget", "ask"]),
        st.integers(0, 2),
        st.sampled_from([None, 0, 1, 50]),  # KV blocks (0: no capacity)
        st.sampled_from([None, 16]),  # block size
        st.sampled_from([0.5, 2.0, 10.0]),  # ttl
        st.floats(0.0, 3.0),  # clock step
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_it_always_equals_the_walk(
    ops: list[tuple[str, int, int | None, int | None, float, float]],
) -> None:
    r = router()
    now = 0.0
    for op, i, blocks, size, ttl, step in ops:
        now += step
        if op == "report":
            r.report(URLS[i], kv(blocks, size), now, ttl_s=ttl)
        elif op == "forget":
            r.report(URLS[i], None, now, ttl_s=ttl)
        assert r.kv_capacities(now) == walk(r, now)
