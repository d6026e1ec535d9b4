"""filters/cost_ledger.py on a crafted log whose answer is worked out by hand below."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.cost_ledger import (
    DEFAULT_PRICES,
    CostLedger,
    FleetSpec,
    PriceTable,
    TimingModel,
    task_key_of,
)
from filters.gpu import GPUS
from meshd.access_log import AccessRecord, AttemptRecord

# Round prices: H100 $3.60/h = $0.001 per GPU-second, A100 $1.80/h = $0.0005 per GPU-second.
PRICES = PriceTable({"H100": 3.6, "A100": 1.8})


def rec(ts: float, rid: str, outcome: str, gpu_s: float, **kw: object) -> AccessRecord:
    fields: dict[str, object] = {
        "prompt_tokens": 100,
        "completion_tokens": 10,
        "gpu": "H100",
        **kw,
    }
    return AccessRecord(ts=ts, request_id=rid, outcome=outcome, gpu_seconds=gpu_s, **fields)  # type: ignore[arg-type]


def crafted_log() -> list[AccessRecord]:
    t1 = {"task_id": "T1", "tenant": "a", "steps_in_task": 5}
    t2 = {"task_id": "T2", "tenant": "b", "steps_in_task": 3, "gpu": "A100"}
    return [
        # T1, 5 steps on H100: steps 0 and 1 succeed, step 2 times out, the agent gives up.
        rec(0, "t1s0", "ok", 2.0, step=0, **t1),  # $0.002
        AccessRecord(  # step 1: a stream broke after 1 GPU-s ($0.001 retry), then ok ($0.003)
            ts=10,
            request_id="t1s1",
            outcome="ok",
            gpu="H100",
            prompt_tokens=100,
            completion_tokens=10,
            step=1,
            attempts=(
                AttemptRecord("http://a", "stream_broken", "reset", gpu="H100", gpu_seconds=1.0),
                AttemptRecord("http://b", "ok", gpu="H100", gpu_seconds=3.0),
            ),
            **t1,  # type: ignore[arg-type]
        ),
        rec(20, "t1s2", "upstream_timeout", 4.0, step=2, **t1),  # $0.004 failed request
        # T2, 3 steps on A100: step 1 is abandoned by the client, resent and succeeds.
        rec(30, "t2s0", "ok", 2.0, step=0, **t2),  # $0.001
        rec(40, "t2s1a", "client_disconnect", 2.0, step=1, **t2),  # $0.001 abandoned
        rec(50, "t2s1b", "ok", 4.0, step=1, **t2),  # $0.002
        rec(60, "t2s2", "ok", 2.0, step=2, **t2),  # $0.001, final step ok: T2 succeeds
        rec(70, "lone-ok", "ok", 1.0, tenant="a"),  # $0.001, a task of its own
        # At ts 1000 T1 has been idle > 600 s: closed as failed before this one counts.
        rec(1000, "lone-bad", "http_500", 0.5, tenant="a"),  # $0.0005 failed request
    ]


def test_crafted_log_known_answer() -> None:
    ledger = CostLedger(PRICES, idle_timeout_s=600)
    closed = ledger.record_all(crafted_log())
    assert [(c.key, c.succeeded, c.reason) for c in closed] == [
        ("task:T2", True, "final_ok"),
        ("request:lone-ok", True, "final_ok"),
        ("task:T1", False, "idle"),
        ("request:lone-bad", False, "final"),
    ]
    s = ledger.summary()
    total = s.total
    # Spend: T1 0.002 + 0.004 + 0.004, T2 0.001 + 0.001 + 0.002 + 0.001, lone 0.001 + 0.0005.
    assert total.cost_usd == pytest.approx(0.0165)
    assert total.gpu_seconds == pytest.approx(2 + 4 + 4 + 2 + 2 + 4 + 2 + 1 + 0.5)
    assert total.waste.retries == pytest.approx(0.001)  # the broken stream of T1 step 1
    assert total.waste.failed_requests == pytest.approx(0.004 + 0.0005)
    assert total.waste.abandoned_streams == pytest.approx(0.001)
    assert total.waste.failed_tasks == pytest.approx(0.002 + 0.003)  # T1 steps 0 and 1
    assert total.useful_usd == pytest.approx(0.004 + 0.001)  # T2's ok steps, lone-ok
    assert total.pending_usd == pytest.approx(0.0)
    assert total.useful_usd + total.waste.total == pytest.approx(total.cost_usd)
    assert (total.tasks_succeeded, total.tasks_failed) == (2, 2)
    assert (total.requests, total.ok_requests) == (9, 6)
    assert total.cost_per_successful_task == pytest.approx(0.0165 / 2)
    assert total.cost_per_request == pytest.approx(0.0165 / 9)
    assert total.cost_per_token == pytest.approx(0.0165 / (9 * 110))
    assert total.success_per_dollar == pytest.approx(2 / 0.0165)
    assert total.waste_ratio == pytest.approx(0.0115 / 0.0165)
    a, b = s.by_tenant["a"], s.by_tenant["b"]
    assert a.cost_usd == pytest.approx(0.0115) and b.cost_usd == pytest.approx(0.005)
    assert (a.tasks_succeeded, a.tasks_failed, b.tasks_succeeded) == (1, 2, 1)
    assert a.cost_per_successful_task == pytest.approx(0.0115)
    assert b.waste.abandoned_streams == pytest.approx(0.001)
    assert s.open_tasks == 0 and s.evicted_tasks == 0 and s.estimated_requests == 0


def test_final_step_failure_keeps_task_open_until_retried() -> None:
    ledger = CostLedger(PRICES)
    base = {"task_id": "T", "steps_in_task": 2}
    ledger.record(rec(0, "s0", "ok", 1.0, step=0, **base))
    assert ledger.record(rec(1, "s1", "http_503", 1.0, step=1, **base)) == []
    (done,) = ledger.record(rec(2, "s1b", "ok", 1.0, step=1, **base))
    assert done.succeeded and done.requests == 3
    assert done.wasted_usd == pytest.approx(0.001)
    s = ledger.summary().total
    assert s.waste.failed_requests == pytest.approx(0.001)
    assert s.useful_usd == pytest.approx(0.002)


def test_final_flag_wins_over_the_step_count() -> None:
    ledger = CostLedger(PRICES, idle_timeout_s=10)
    plan = {"task_id": "T", "steps_in_task": 5}
    # Finishing early: step 1 of 5 marked final closes the task as a success.
    ledger.record(rec(0, "s0", "ok", 1.0, step=0, **plan))
    (early,) = ledger.record(rec(1, "s1", "ok", 1.0, step=1, final=True, **plan))
    assert (early.succeeded, early.reason, early.requests) == (True, "final_ok", 2)
    # Adding steps: the counted last step says final=false, so the task stays open...
    more = {"task_id": "U", "steps_in_task": 2}
    assert ledger.record(rec(2, "u1", "ok", 1.0, step=1, final=False, **more)) == []
    assert ledger.summary().open_tasks == 1
    (done,) = ledger.record(rec(3, "u2", "ok", 1.0, step=2, final=True, **more))
    assert (done.key, done.succeeded, done.requests) == ("task:U", True, 2)
    # ...and a task whose client marks `final` but never sent final=true failed when idle.
    ledger.record(rec(4, "v0", "ok", 1.0, task_id="V", step=0, final=False))
    (idle,) = ledger.close_idle(20)
    assert (idle.key, idle.succeeded, idle.reason) == ("task:V", False, "idle")
    s = ledger.summary().total
    assert (s.tasks_succeeded, s.tasks_failed) == (2, 1)
    assert s.useful_usd == pytest.approx(0.004) and s.waste.failed_tasks == pytest.approx(0.001)


def test_task_without_step_info_is_judged_by_last_request() -> None:
    ledger = CostLedger(PRICES, idle_timeout_s=10)
    ledger.record(rec(0, "w0", "ok", 1.0, workflow_id="W"))
    ledger.record(rec(1, "w1", "ok", 1.0, workflow_id="W"))
    assert ledger.summary().total.pending_usd == pytest.approx(0.002)
    assert ledger.summary().open_tasks == 1
    (done,) = ledger.close_all()
    assert done.key == "workflow:W" and done.succeeded and done.reason == "flushed"


def test_open_tasks_are_bounded() -> None:
    ledger = CostLedger(PRICES, max_open_tasks=2)
    for i in range(3):
        ledger.record(rec(i, f"r{i}", "ok", 1.0, task_id=f"T{i}", steps_in_task=3, step=0))
    s = ledger.summary()
    assert s.open_tasks == 2 and s.evicted_tasks == 1
    assert s.total.tasks_failed == 1  # T0 never reached its final step
    assert s.total.waste.failed_tasks == pytest.approx(0.001)
    with pytest.raises(ValueError):
        CostLedger(max_open_tasks=0)


def test_estimate_from_timing_model_by_hand() -> None:
    # No reported GPU-seconds: 27,712 uncached prompt tokens on an H100 prefill in 1 s;
    # 32 output tokens at a shared batch of 32 cost 32 x step(32) / 32 = one step at b=32,
    # step(32) = 7.45 ms + (11.13 - 7.45) ms x 31/63.
    ledger = CostLedger(PRICES, TimingModel(decode_batch=32))
    r = AccessRecord(
        ts=0,
        request_id="e",
        outcome="ok",
        gpu="NVIDIA H100 80GB HBM3",
        prompt_tokens=27_712 + 1000,
        cached_tokens=1000,
        completion_tokens=32,
    )
    ledger.record(r)
    s = ledger.summary()
    step = 0.00745 + (0.01113 - 0.00745) * 31 / 63
    assert s.total.gpu_seconds == pytest.approx(1.0 + step)
    assert s.total.cost_usd == pytest.approx((1.0 + step) * 0.001)
    assert s.estimated_requests == 1
    # A connect error never reached an engine: free. An unknown GPU is priced as "unknown".
    ledger.record(
        AccessRecord(
            ts=1,
            request_id="c",
            outcome="ok",
            gpu="L4",
            prompt_tokens=0,
            completion_tokens=0,
            attempts=(AttemptRecord("http://x", "connect_error"), AttemptRecord("http://y", "ok")),
        )
    )
    assert ledger.summary().total.waste.retries == 0.0


def test_price_table_defaults_and_errors() -> None:
    assert {k: DEFAULT_PRICES[k] for k in ("A100", "H100", "H200", "B200")} == {
        k: GPUS[k].price_per_gpu_hour for k in ("A100", "H100", "H200", "B200")
    }
    prices = PriceTable({"b200-sxm": 6.0, "L40S": 1.0})
    assert prices.per_hour("NVIDIA B200") == 6.0
    assert prices.per_hour("L40S") == 1.0
    assert prices.per_hour("mystery") == DEFAULT_PRICES["unknown"]
    assert math.isclose(prices.per_second("H100"), DEFAULT_PRICES["H100"] / 3600)
    with pytest.raises(ValueError):
        PriceTable({"H100": 0})


def test_task_key() -> None:
    assert task_key_of(rec(0, "r", "ok", 1, task_id="t", workflow_id="w")) == "task:t"
    assert task_key_of(rec(0, "r", "ok", 1, workflow_id="w")) == "workflow:w"
    assert task_key_of(rec(0, "r", "ok", 1)) == "request:r"


# ---- the fixed-fleet view ---------------------------------------------------------------


def on(
    endpoint: str, gpu: str, ts: float, e2e_s: float, gpu_s: float, **kw: object
) -> AccessRecord:
    """A request served by one attempt on `endpoint`."""
    attempt = AttemptRecord(endpoint, "ok", gpu=gpu, gpu_seconds=gpu_s)
    return rec(ts, f"{endpoint}@{ts}", "ok", gpu_s, gpu=gpu, e2e_s=e2e_s, attempts=(attempt,), **kw)


def two_generations() -> list[AccessRecord]:
    # An H100 busy 4 s (of a 10 s request) at ts 0, an A100 busy 20 s at ts 50 until 100.
    return [on("http://h", "H100", 0, 10, 4.0), on("http://a", "A100", 50, 50, 20.0)]


def test_fixed_fleet_two_generations_known_answer() -> None:
    ledger = CostLedger(PRICES)
    ledger.record_all(two_generations())
    s = ledger.summary()
    # Elastic: 4 x $0.001 + 20 x $0.0005 = $0.014 over 2 ok tasks.
    assert s.total.cost_usd == pytest.approx(0.014)
    assert s.cost_per_successful_task == pytest.approx(0.007)
    # Fixed: both GPUs paid for ts 0..100 at $0.001 + $0.0005 per second = $0.15.
    fx = s.fixed
    assert fx is not None and not fx.declared
    assert (fx.endpoints, fx.gpus, fx.window_s) == (2, 2, pytest.approx(100.0))
    assert fx.usd_per_s == pytest.approx(0.0015)
    assert fx.spend_usd == pytest.approx(0.15)
    assert fx.busy_usd == pytest.approx(0.014)
    assert fx.utilisation == pytest.approx(0.014 / 0.15)
    assert fx.idle_usd == pytest.approx(0.136)
    assert fx.cost_per_successful_task == pytest.approx(0.075)
    assert fx.success_per_dollar == pytest.approx(2 / 0.15)
    # The same fleet named by the caller gives the same figures; a window of its own scales.
    declared = CostLedger(PRICES, fleet={"http://h": "H100", "http://a": ("A100", 1)})
    declared.record_all(two_generations())
    dfx = declared.summary().fixed
    assert dfx is not None and dfx.declared and dfx.spend_usd == pytest.approx(0.15)
    hour = declared.summary(window_s=3600).fixed
    assert hour is not None and hour.spend_usd == pytest.approx(5.4)
    assert hour.window_s == 3600


def test_fixed_window_grows_with_records() -> None:
    ledger = CostLedger(PRICES, fleet={"http://h": "H100"})
    fx = ledger.summary().fixed  # no record yet: an empty window costs nothing
    assert fx is not None and (fx.window_s, fx.spend_usd, fx.idle_usd) == (0.0, 0.0, 0.0)
    assert fx.utilisation is None and fx.cost_per_successful_task is None
    spends = []
    for r in (on("http://h", "H100", 10, 5, 1.0), on("http://h", "H100", 40, 20, 1.0)):
        ledger.record(r)
        now = ledger.summary().fixed
        assert now is not None
        spends.append((now.window_s, now.spend_usd))
    # 10..15, then 10..60 (the latest end, not the latest arrival).
    assert spends == [(pytest.approx(5.0), pytest.approx(0.005)), (50.0, pytest.approx(0.05))]
    # A request that ended before the latest end does not shrink the window; one without
    # e2e_s ends when it arrived.
    ledger.record(rec(70, "late", "ok", 1.0, endpoint="http://h"))
    assert ledger.window_s == pytest.approx(60.0)


def test_idle_endpoints_of_the_fleet_are_paid_for() -> None:
    # spare never serves a request: its 8 H100s cost $0.008/s all the same.
    fleet: dict[str, FleetSpec] = {"http://h": "H100", "http://a": "A100", "spare": ("H100", 8)}
    ledger = CostLedger(PRICES, fleet=fleet)
    ledger.record_all(two_generations())
    fx = ledger.summary().fixed
    assert fx is not None
    assert (fx.endpoints, fx.gpus) == (3, 10)
    assert fx.spend_usd == pytest.approx((0.0015 + 0.008) * 100)
    assert fx.cost_per_successful_task == pytest.approx(0.95 / 2)
    assert fx.utilisation == pytest.approx(0.014 / 0.95)


def test_fixed_view_without_successful_tasks_or_fleet() -> None:
    ledger = CostLedger(PRICES)
    assert ledger.summary().fixed is None  # nothing seen, nothing given
    ledger.record(rec(0, "x", "http_500", 1.0, endpoint="http://h", e2e_s=2.0))
    fx = ledger.summary().fixed
    assert fx is not None and fx.tasks_succeeded == 0
    assert fx.spend_usd == pytest.approx(0.002)
    assert fx.cost_per_successful_task is None
    assert fx.success_per_dollar == 0.0
    # Records that name no endpoint (no attempts, no `endpoint`) leave the fleet unknown.
    bare = CostLedger(PRICES)
    bare.record_all(crafted_log()[:1])
    assert bare.summary().fixed is None


def test_elastic_figures_unchanged_by_the_fleet() -> None:
    plain, fleet = CostLedger(PRICES), CostLedger(PRICES, fleet={"http://z": ("B200", 4)})
    for ledger in (plain, fleet):
        ledger.record_all(crafted_log())
        ledger.close_all()
    a, b = plain.summary(), fleet.summary(window_s=10)
    assert (a.total, a.by_tenant, a.by_model) == (b.total, b.by_tenant, b.by_model)
    assert a.total.cost_usd == pytest.approx(0.0165)  # test_crafted_log_known_answer's figure


def test_seen_fleet_prices_the_latest_gpu_and_is_bounded() -> None:
    ledger = CostLedger(PRICES, max_fleet_endpoints=1)
    ledger.record(rec(0, "r0", "ok", 1.0, endpoint="http://h", gpu=None, e2e_s=10))
    fx = ledger.summary().fixed
    assert fx is not None  # an endpoint that named no GPU is priced as "unknown"
    assert fx.usd_per_s == pytest.approx(DEFAULT_PRICES["unknown"] / 3600)
    ledger.record(rec(1, "r1", "ok", 1.0, endpoint="http://h", gpu="A100"))
    ledger.record(rec(2, "r2", "ok", 1.0, endpoint="http://other", gpu="H100"))
    fx = ledger.summary().fixed
    assert fx is not None and fx.endpoints == 1 and fx.untracked_attempts == 1
    assert fx.usd_per_s == pytest.approx(0.0005)


def test_fixed_view_rejects_bad_input() -> None:
    for fleet in ({}, {"x": ("H100", 0)}, {"x": ("H100", True)}):
        with pytest.raises(ValueError):
            CostLedger(fleet=fleet)
    with pytest.raises(ValueError):
        CostLedger(max_fleet_endpoints=0)
    with pytest.raises(ValueError):
        CostLedger().summary(window_s=-1)


@settings(max_examples=80, deadline=None)
@given(
    plan=st.lists(
        st.tuples(
            st.integers(0, 3),  # endpoint
            st.floats(0, 50),  # gap before this request on its endpoint
            st.floats(0, 30),  # its duration
            st.floats(0, 1),  # the busy share of that duration
            st.sampled_from(["ok", "http_500", "client_disconnect"]),
        ),
        max_size=30,
    ),
    spare=st.integers(0, 3),
)
def test_fixed_spend_covers_busy_spend(
    plan: list[tuple[int, float, float, float, str]], spare: int
) -> None:
    """Where the fleet holds every endpoint used, and no endpoint is busy longer than the
    window, the fleet costs at least what its busy GPU-seconds cost."""
    gpus = ["H100", "A100", "H200", "B200"]
    free_at = [0.0] * len(gpus)  # requests on one endpoint follow each other
    records = []
    for i, (e, gap, duration, share, outcome) in enumerate(plan):
        start = free_at[e] + gap
        free_at[e] = start + duration
        attempt = AttemptRecord(f"e{e}", outcome, gpu=gpus[e], gpu_seconds=duration * share)
        records.append(
            AccessRecord(
                ts=start, request_id=f"r{i}", outcome=outcome, e2e_s=duration, attempts=(attempt,)
            )
        )
    fleet = {f"e{e}": gpus[e] for e in range(len(gpus))} | {
        f"spare{k}": "A100" for k in range(spare)
    }
    for ledger in (CostLedger(fleet=fleet), CostLedger()):
        ledger.record_all(sorted(records, key=lambda r: r.ts))
        s = ledger.summary()
        if s.fixed is None:
            assert not records
            continue
        assert s.fixed.busy_usd == s.total.cost_usd
        # The window is a difference of arrival times: it may lose an ulp of them (1e-12 s).
        assert s.fixed.spend_usd >= s.total.cost_usd * (1 - 1e-9) - 1e-12
        assert s.fixed.idle_usd >= 0.0


def test_a_prefill_step_that_served_the_answer_is_useful_not_a_retry() -> None:
    # Found by the P/D bench: the prefill leg of every split request was booked as waste.
    from meshd.access_log import AccessRecord, AttemptRecord

    def split(prefill_outcome: str) -> AccessRecord:
        return AccessRecord(
            ts=0.0, request_id=f"r-{prefill_outcome}", outcome="ok", status=200, pool="decode",
            gpu="H100", prompt_tokens=16000, cached_tokens=15999, completion_tokens=250,
            e2e_s=5.0, pd="split",
            attempts=(
                AttemptRecord("http://p0", prefill_outcome, reason="prefill", gpu="H100",
                              completion_tokens=1, cached_tokens=0),
                AttemptRecord("http://d0", "ok", gpu="H100", cached_tokens=15999),
            ),
        )  # fmt: skip

    ledger = CostLedger()
    ledger.record(split("ok"))
    ledger.close_all()
    total = ledger.summary().total
    assert total.waste.retries == 0 and total.useful_usd == pytest.approx(total.cost_usd)
    # The decode attempt made all 250 tokens the client got (the prefill's one is not sent).
    costs = ledger.attempt_costs(split("ok"))
    alone = CostLedger().timing.gpu_seconds("H100", 16000, 15999, 250)
    assert costs[-1][0] == pytest.approx(alone)
    # A prefill step that failed is a retry like any other.
    failed = CostLedger()
    failed.record(split("http_503"))
    failed.close_all()
    assert failed.summary().total.waste.retries > 0
