"""meshd/autoscale_metrics.py: PoolSignals.demand, which keeps each endpoint's capacity
while nothing it depends on changed (CapacityTally), gives what the walk over every
endpoint (PoolSignals.walk, replica_capacity each) gives, exactly, after any sequence of
reports, requests, flags, failures, calibrations and clock moves (forward and back)."""

from __future__ import annotations

from typing import Any

from harness import sidecar_config
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.autoscale import DemandBoard
from filters.endpoint_state import ReportedState
from meshd.autoscale_metrics import PoolSignals
from meshd.pools import build_routers

URLS = [f"http://10.0.0.{i}:8000" for i in range(4)]
POOLS = [
    {"name": "a", "endpoints": [{"url": u, "gpu": "H100"} for u in URLS]},
    {"name": "b", "endpoints": [{"url": u} for u in URLS[:2]]},
]
CONFIGS = {
    policy: sidecar_config([], pools=POOLS, routing={"policy": policy})
    for policy in ("meshd", "round-robin")
}

reports = st.builds(
    ReportedState,
    healthy=st.booleans(),
    draining=st.booleans(),
    gpu=st.sampled_from([None, "", "H100", "A100", "NVIDIA B200", "unheard-of"]),
    gpu_count=st.sampled_from([None, 1, 8]),
    kv_block_size=st.sampled_from([None, 16]),
    kv_capacity_blocks=st.sampled_from([None, 0, 1_000, 40_000]),
    kv_usage=st.sampled_from([None, 0.0, 0.25, 1.0]),
    requests_running=st.integers(0, 64),
    requests_waiting=st.integers(0, 8),
    tokens_in_flight=st.sampled_from([0, 1_000, 10**6]),
)
times = st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.5, 4.0, 7.0, 30.0])
ops = st.one_of(
    st.tuples(
        st.just("report"), st.integers(0, 3), st.none() | reports, st.sampled_from([1.0, 5.0])
    ),
    st.tuples(st.just("same-report"), st.integers(0, 3)),
    st.tuples(st.just("start"), st.integers(0, 3), st.integers(1, 4_000)),
    st.tuples(st.just("first-token"), st.integers(0, 3)),
    st.tuples(st.just("finish"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("flags"), st.integers(0, 3), st.booleans(), st.none() | times),
    st.tuples(st.just("connect-failure"), st.integers(0, 3)),
    st.tuples(st.just("age"), st.integers(0, 3)),
    st.tuples(st.just("gpu"), st.integers(0, 3), st.sampled_from(["H100", "A100", "L4"])),
    st.tuples(st.just("clock"), times),
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(CONFIGS)), st.lists(ops, max_size=40))
def test_demand_is_the_walks_after_any_changes(policy: str, steps: list[tuple[Any, ...]]) -> None:
    """round-robin: the signals' own endpoints (its router has no EndpointStates), only
    reports and time reaching them as the router's reports do not."""
    config = CONFIGS[policy]
    routers = build_routers(config)
    signals = PoolSignals(config, routers, {}, DemandBoard(["a", "b"]))
    router = routers["a"]
    states = getattr(router, "states", None) or signals._static["a"]
    now, rid = 0.0, 0
    for step in [("clock", 0.0), *steps]:
        kind, *args = step
        if kind == "clock":
            now = args[0]
        elif kind == "report":
            router.report(URLS[args[0]], args[1], now, ttl_s=args[2])
        elif kind == "same-report":  # renewed as the control feed's refresh does
            s = states[args[0]]
            router.report(s.url, s.reported, now, ttl_s=s.report_ttl_s)
        elif kind == "start":
            rid += 1
            states[rid % 4].start(rid, now, prompt_tokens=args[1])
        elif kind == "first-token":
            s = states[args[0]]
            for r in list(s._inflight):
                s.first_token(r, now + 0.2)
        elif kind == "finish":
            s = states[args[0]]
            for r in list(s._inflight)[:1]:
                s.finish(r, now + 1.0, ok=args[1], output_tokens=50)
        elif kind == "flags":
            router.set_flags(URLS[args[0]], breaker_open=args[1], ejected_until=args[2], now=now)
        elif kind == "connect-failure":
            states[args[0]].connect_failure(now)
        elif kind == "age":
            states[args[0]].age_calibration(now + 600.0)
        elif kind == "gpu":  # assigned directly, then touched (EndpointState's contract)
            s = states[args[0]]
            s.gpu = args[1]
            s.touch()
        for pool in ("a", "b"):
            assert signals.demand(pool, now) == signals.walk(pool, now), (pool, step)
