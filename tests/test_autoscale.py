"""The autoscaling signals (filters/autoscale.py): the demand window, its merge across
sidecars, and the desired-replicas figure (docs/autoscaling.md): monotonic in demand,
clamped, raised by an SLO breach, a queue and shedding, and steady under a steady load."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.autoscale import (
    DECODE_BATCH,
    MAX_SLO_STEP,
    TOLERANCE,
    DemandBoard,
    DemandMeter,
    PoolDemand,
    ReplicaPlanner,
    ScalingPolicy,
    merge_demand,
    replica_capacity,
)
from filters.endpoint_state import EndpointState, ReportedState
from filters.gpu import GPUS, GpuTable

H100 = GPUS["H100"]
CP = H100.prefill_tokens_per_s
CD = DECODE_BATCH / H100.decode_step_s(DECODE_BATCH)


def demand(prefill: float = 0.0, decode: float = 0.0, **kw: float) -> PoolDemand:
    base = {
        "replica_prefill_tokens_per_s": CP,
        "replica_decode_tokens_per_s": CD,
        "replicas": 4,
    }
    base.update(kw)
    return PoolDemand(prefill_tokens_per_s=prefill, decode_tokens_per_s=decode, **base)  # type: ignore[arg-type]


def planner(**kw: float) -> ReplicaPlanner:
    return ReplicaPlanner(ScalingPolicy(**kw))  # type: ignore[arg-type]


# -- the demand window -------------------------------------------------------------------


def test_rates_over_the_window_and_its_start() -> None:
    m = DemandMeter(window_s=10.0, now=0.0)
    for t in range(20):  # one request a second: 500 uncached prompt, 100 completion tokens
        m.finished(t + 0.5, prefill_tokens=500, decode_tokens=100, predicted_ttft_s=0.2)
    d = m.demand(20.0)
    assert d.requests_per_s == pytest.approx(1.0)
    assert d.prefill_tokens_per_s == pytest.approx(500.0)
    assert d.decode_tokens_per_s == pytest.approx(100.0)
    assert d.mean_prefill_tokens == pytest.approx(500.0)
    assert 0.2 <= d.predicted_ttft_s <= 0.2 * 2**0.25  # type: ignore[operator]
    # Early on, the rate is over the time since the start, not the whole window.
    early = DemandMeter(window_s=30.0, now=0.0)
    for t in range(5):
        early.finished(t + 0.5, prefill_tokens=500, decode_tokens=100)
    assert early.demand(5.0).prefill_tokens_per_s == pytest.approx(500.0)
    # Once the traffic stops, the window empties.
    assert m.demand(40.0).prefill_tokens_per_s == 0.0
    assert m.demand(40.0).predicted_ttft_s is None


def test_predicted_ttft_is_the_windows_p90() -> None:
    m = DemandMeter(window_s=10.0, now=0.0)
    for i in range(100):
        m.finished(1.0 + i * 0.01, prefill_tokens=1, decode_tokens=1, predicted_ttft_s=i / 100)
    p90 = m.demand(3.0).predicted_ttft_s
    assert p90 is not None and 0.89 <= p90 <= 0.89 * 1.2


def test_shed_and_fallbacks_are_counted_and_unmet_demand() -> None:
    m = DemandMeter(window_s=10.0, now=0.0)
    for t in range(10):
        m.finished(t + 0.1, prefill_tokens=1000, decode_tokens=200)
        m.shed(t + 0.2, prompt_tokens=1000)
        m.fell_back(t + 0.3, prompt_tokens=1000)
        m.fell_back(t + 0.4, prompt_tokens=1000, unmet=False)  # a cost cap: not demand here
    d = m.demand(10.0)
    assert m.shed_total == 10 and m.fallbacks_total == 20
    assert d.shed_per_s == pytest.approx(1.0)
    assert d.fallbacks_per_s == pytest.approx(2.0)
    assert d.unmet_prefill_tokens_per_s == pytest.approx(2000.0)
    assert d.unmet_decode_tokens_per_s == pytest.approx(400.0)  # 2/s x mean 200 served


def test_board_ignores_unknown_pools() -> None:
    b = DemandBoard(["a"], window_s=5.0)
    b.finished("a", 1.0, prefill_tokens=10, decode_tokens=5)
    b.finished("zz", 1.0, prefill_tokens=10, decode_tokens=5)
    b.shed("zz", 1.0)
    b.fell_back("zz", 1.0)
    assert b.meters["a"].demand(2.0).requests_per_s > 0
    assert set(b.meters) == {"a"}


# -- merged across sidecars ---------------------------------------------------------------


def test_merge_sums_rates_and_takes_engines_once() -> None:
    a = demand(1000, 100, requests_per_s=2, queue_depth=3, engine_queue_depth=5,
               kv_used_tokens=100, kv_capacity_tokens=1000, shed_per_s=1)  # fmt: skip
    b = demand(3000, 300, requests_per_s=6, queue_depth=1, engine_queue_depth=4,
               kv_used_tokens=200, kv_capacity_tokens=1000, shed_per_s=0.5)  # fmt: skip
    m = merge_demand([a, b])
    assert m.prefill_tokens_per_s == 4000 and m.decode_tokens_per_s == 400
    assert m.shed_per_s == 1.5 and m.queue_depth == 4
    assert m.engine_queue_depth == 5  # the same engines seen twice: not 9
    assert m.kv_used_tokens == 200 and m.kv_capacity_tokens == 1000
    assert m.replicas == 4
    assert m.mean_prefill_tokens == pytest.approx(500.0)
    assert merge_demand([]) == PoolDemand()


def test_merged_figure_is_the_one_sidecars_sum_would_give() -> None:
    """Two sidecars each seeing half the traffic give the figure one sidecar seeing all of
    it gives (one figure per pool, not one per sidecar)."""
    half = demand(0.4 * CP * 4, 0.4 * CD * 2, requests_per_s=10)
    whole = demand(0.8 * CP * 4, 0.8 * CD * 2, requests_per_s=20)
    assert planner().terms(merge_demand([half, half])).raw == pytest.approx(
        planner().terms(whole).raw
    )


# -- the figure --------------------------------------------------------------------------


def test_formula_hand_computed() -> None:
    # 2 replicas' worth of prefill time and 1 of decode time at utilisation 0.7: 3 / 0.7.
    t = planner().terms(demand(2 * CP, CD))
    assert t.load == pytest.approx(3 / 0.7)
    assert t.reason == "load"
    plan = planner().plan(demand(2 * CP, CD), 0.0)
    assert plan.desired == 5  # ceil(4.29 x 1.1)


def test_clamps() -> None:
    assert planner(min_replicas=2).plan(demand(), 0.0).desired == 2
    assert planner(min_replicas=0).plan(demand(), 0.0).desired == 0  # scale to zero
    p = planner(max_replicas=8).plan(demand(100 * CP), 0.0)
    assert p.desired == 8 and p.reason == "max"


_rate = st.floats(min_value=0, max_value=50 * CP, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(p1=_rate, p2=_rate, d1=_rate, d2=_rate, q=st.integers(0, 500), shed=_rate)
def test_monotonic_in_demand(
    p1: float, p2: float, d1: float, d2: float, q: int, shed: float
) -> None:
    lo = demand(min(p1, p2), min(d1, d2), engine_queue_depth=q, mean_prefill_tokens=1000)
    hi = dataclasses.replace(
        lo,
        prefill_tokens_per_s=max(p1, p2),
        decode_tokens_per_s=max(d1, d2),
        unmet_prefill_tokens_per_s=shed,
    )
    a = planner(max_replicas=1000).plan(lo, 0.0)
    b = planner(max_replicas=1000).plan(hi, 0.0)
    assert b.desired >= a.desired
    assert 1 <= a.desired <= 1000


@settings(max_examples=100, deadline=None)
@given(p=_rate, mn=st.integers(0, 20), span=st.integers(0, 30))
def test_always_within_bounds(p: float, mn: int, span: int) -> None:
    pl = planner(min_replicas=mn, max_replicas=mn + max(span, 1) if mn == 0 else mn + span)
    got = pl.plan(demand(p), 0.0).desired
    assert pl.policy.min_replicas <= got <= pl.policy.max_replicas


def test_slo_breach_raises_it_and_is_capped() -> None:
    light = demand(0.1 * CP, predicted_ttft_s=0.5)
    within = planner(slo_ttft_s=1.0).plan(light, 0.0)
    assert within.slo == 0.0 and within.desired == 1
    breach = planner(slo_ttft_s=1.0).plan(dataclasses.replace(light, predicted_ttft_s=1.5), 0.0)
    assert breach.reason == "slo" and breach.slo == pytest.approx(4 * 1.5)
    assert breach.desired > within.desired
    huge = planner(slo_ttft_s=1.0).terms(dataclasses.replace(light, predicted_ttft_s=50.0))
    assert huge.slo == pytest.approx(4 * MAX_SLO_STEP)
    # No SLO configured: the prediction does not count.
    assert planner().terms(dataclasses.replace(light, predicted_ttft_s=50.0)).slo == 0.0


def test_queue_raises_it() -> None:
    base = demand(CP, mean_prefill_tokens=2000)
    calm = planner().terms(base)
    queued = planner().terms(dataclasses.replace(base, queue_depth=50, engine_queue_depth=20))
    # 70 requests x 2000 tokens to drain in 10 s at one replica's prefill speed.
    assert queued.queue == pytest.approx(70 * 2000 / CP / 10)
    assert queued.load > calm.load


def test_shed_requests_raise_it() -> None:
    base = demand(2 * CP, CD)
    shed = dataclasses.replace(base, unmet_prefill_tokens_per_s=2 * CP, shed_per_s=5)
    assert planner().plan(shed, 0.0).desired > planner().plan(base, 0.0).desired


def test_full_kv_raises_it() -> None:
    d = demand(0.1 * CP, kv_used_tokens=0.95 * 4 * 400_000, kv_capacity_tokens=4 * 400_000)
    t = planner().terms(d)
    assert t.kv == pytest.approx(4 * 0.95 / 0.7) and t.reason == "kv"
    assert d.kv_headroom == pytest.approx(0.05)


def test_no_flapping_under_a_constant_noisy_load() -> None:
    """Demand wobbling +-3% around a replica boundary: the figure settles and stays."""
    pl = planner(scale_down_delay_s=60.0)
    figures = []
    for i in range(600):  # 10 minutes, a decision a second
        wobble = 1.0 + 0.03 * ((-1) ** i) * ((i * 7) % 5) / 4
        d = demand(4.0 * 0.7 * CP * wobble / (1 + TOLERANCE))
        figures.append(pl.plan(d, float(i)).desired)
    steady = figures[60:]
    assert len(set(steady)) == 1, sorted(set(steady))


def test_rises_at_once_and_falls_after_the_delay() -> None:
    pl = planner(scale_down_delay_s=30.0)
    assert pl.plan(demand(0.7 * CP), 0.0).desired == 2
    assert pl.plan(demand(7 * CP), 1.0).desired == 11  # the step up: at once
    # Demand back down: held for the delay, then down.
    held = [pl.plan(demand(0.7 * CP), t).desired for t in (2.0, 15.0, 30.9)]
    assert held == [11, 11, 11]
    later = pl.plan(demand(0.7 * CP), 31.5)
    assert later.desired == 2


def test_scaled_to_zero_uses_the_fallback_capacity() -> None:
    """No endpoint is known (the pool at zero replicas) while requests are shed: one
    replica's capacity from the pool's GPU class, so the figure is not 0."""
    cap = replica_capacity(EndpointState("x", gpu="H100"), GpuTable(), 0.0)
    pl = ReplicaPlanner(ScalingPolicy(min_replicas=0), fallback_capacity=cap)
    d = PoolDemand(unmet_prefill_tokens_per_s=1000, shed_per_s=1)
    assert pl.plan(d, 0.0).desired >= 1


def test_replica_capacity_uses_learnt_speed_and_reports() -> None:
    gpus = GpuTable()
    e = EndpointState("e", gpu="H100", gpu_count=2)
    fresh = replica_capacity(e, gpus, 0.0)
    assert fresh.prefill_tokens_per_s == pytest.approx(2 * CP)
    assert fresh.decode_tokens_per_s == pytest.approx(2 * CD)
    e.ttft_ratio, e.decode_ratio = 2.0, 1.5  # learnt: slower than its table
    slow = replica_capacity(e, gpus, 0.0)
    assert slow.prefill_tokens_per_s == pytest.approx(CP)
    assert slow.decode_tokens_per_s == pytest.approx(2 * CD / 1.5)
    e.report(
        ReportedState(kv_block_size=16, kv_capacity_blocks=1000, kv_usage=0.25,
                      requests_waiting=7),
        0.0,
    )  # fmt: skip
    r = replica_capacity(e, gpus, 1.0)
    assert r.kv_capacity_tokens == 16_000 and r.kv_used_tokens == pytest.approx(4000)
    assert r.queued == 7 and r.eligible


def test_policy_checks() -> None:
    with pytest.raises(ValueError):
        ScalingPolicy(min_replicas=5, max_replicas=2)
    with pytest.raises(ValueError):
        ScalingPolicy(target_utilization=0)
    with pytest.raises(ValueError):
        DemandMeter(window_s=1.0, bucket_s=2.0)


def test_without_the_delay_that_load_would_flap() -> None:
    """The load of the test above does cross a replica boundary (so that test can fail)."""
    pl = planner(scale_down_delay_s=0.0)
    seen = set()
    for i in range(60):
        wobble = 1.0 + 0.03 * ((-1) ** i) * ((i * 7) % 5) / 4
        seen.add(pl.plan(demand(4.0 * 0.7 * CP * wobble / (1 + TOLERANCE)), float(i)).desired)
    assert seen == {4, 5}


def test_a_load_step_shows_within_the_fast_window_and_fades_over_the_whole() -> None:
    def feed(m: DemandMeter) -> list[float]:
        seen = []
        for t in range(60):
            rate = 10 if 30 <= t < 40 else 1
            for k in range(rate):
                m.finished(t + k / rate, prefill_tokens=100, decode_tokens=10)
            seen.append(m.demand(t + 1.0).requests_per_s)
        return seen

    fast = feed(DemandMeter(window_s=30.0, now=0.0))
    slow = feed(DemandMeter(window_s=30.0, now=0.0, fast_window_s=0.0))
    # 5 s into the step: the fast window's 10/s; the whole window alone is still near 2.5.
    assert fast[34] == pytest.approx(10.0)
    assert slow[34] == pytest.approx((24 + 50) / 29)  # buckets 6..34, 29 s of them
    # After the step: the whole window's rate, which remembers it for 30 s.
    assert fast[45] == pytest.approx(slow[45]) and fast[45] > 3
    assert all(f >= s for f, s in zip(fast, slow, strict=True))


def test_the_noise_of_a_steady_load_is_not_a_step() -> None:
    """+-20% from second to second: the window's rate, as without the fast window."""
    a = DemandMeter(window_s=30.0, now=0.0)
    b = DemandMeter(window_s=30.0, now=0.0, fast_window_s=0.0)
    for t in range(90):
        n = (12, 8, 10)[t % 3]
        for m in (a, b):
            for k in range(n):
                m.finished(t + k / n, prefill_tokens=100, decode_tokens=10)
        assert a.demand(t + 1.0) == b.demand(t + 1.0)
