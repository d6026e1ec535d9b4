"""The request's accounting in fewer calls (issue #22): the timing model without max(),
GPU names remembered, the metric children's one-call adders and setters, and a lone
request's TaskResult built as a tuple; each gives what the longer way gave."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge

import filters.gpu as gpu_mod
from filters.cost_ledger import (
    ESTIMATED,
    MEASURED,
    NO_WORK,
    REPORTED,
    AttemptCost,
    CostLedger,
    TaskResult,
    TimingModel,
)
from filters.gpu import GpuTable, normalise_gpu_name
from meshd.metrics import DataPlaneMetrics, checked_adder, gauge_setter

_numbers = st.one_of(
    st.integers(-10_000, 200_000),
    st.floats(allow_nan=True, allow_infinity=False, width=64),
)


def _gpu_seconds_with_max(
    timing: TimingModel, gpu: str | None, prompt: float, cached: float, completion: float
) -> float:
    """TimingModel.gpu_seconds as it was written with max() (the reference)."""
    profile = timing.gpus.get(gpu)
    prefill = max(0, prompt - max(0, cached)) / profile.prefill_tokens_per_s
    batch = max(1, timing.decode_batch)
    slope = (profile.decode_step_s_b64 - profile.decode_step_s_b1) / 63.0
    step = profile.decode_step_s_b1 + slope * (max(1, batch) - 1)
    decode = max(0, completion) * step / batch
    return prefill + decode


@settings(max_examples=150, deadline=None)
@given(
    gpu=st.sampled_from([None, "", "H100", "nvidia a100-sxm4-80gb", "L40S", "B200"]),
    prompt=_numbers,
    cached=_numbers,
    completion=_numbers,
    batch=st.integers(-3, 300),
)
def test_gpu_seconds_as_with_max(
    gpu: str | None, prompt: float, cached: float, completion: float, batch: int
) -> None:
    timing = TimingModel(decode_batch=batch)
    got = timing.gpu_seconds(gpu, prompt, cached, completion)  # type: ignore[arg-type]
    want = _gpu_seconds_with_max(timing, gpu, prompt, cached, completion)
    assert got == want or (math.isnan(got) and math.isnan(want))


@settings(max_examples=200, deadline=None)
@given(name=st.one_of(st.none(), st.text(max_size=24)))
def test_normalised_names_remembered_as_computed(name: str | None) -> None:
    first = normalise_gpu_name(name)
    assert normalise_gpu_name(name) == first
    assert first == ("unknown" if not name else gpu_mod._normalise(name))


def test_normalised_names_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_mod, "_normalised", {})
    monkeypatch.setattr(gpu_mod, "MAX_NORMALISED_NAMES", 3)
    names = [f"gpu-{i}" for i in range(6)] + ["NVIDIA H100 80GB HBM3"]
    assert [normalise_gpu_name(n) for n in names] == [gpu_mod._normalise(n) for n in names]
    assert len(gpu_mod._normalised) == 3
    assert GpuTable().get("NVIDIA H100 80GB HBM3").name == "H100"


def test_checked_adder_is_counter_inc() -> None:
    m = DataPlaneMetrics()
    child = m.cost_usd.labels("pool", "H100")
    add = checked_adder(child)
    add(1.5)
    add(0)
    add(float("nan"))  # Counter.inc takes NaN too (NaN < 0 is false)
    with pytest.raises(ValueError, match="non-negative"):
        add(-0.5)
    assert math.isnan(child._value.get())
    plain = Counter("plain_total", "a library counter", ["x"], registry=CollectorRegistry())
    assert checked_adder(plain.labels("a")) == plain.labels("a").inc  # not a LoopValue


def test_gauge_setter_is_gauge_set() -> None:
    m = DataPlaneMetrics()
    child = m.tokens_in_flight.labels("pool")
    set_value = gauge_setter(child)
    set_value(7)
    assert child._value.get() == 7.0 and type(child._value.get()) is float
    plain = Gauge("plain", "a library gauge", ["x"], registry=CollectorRegistry())
    assert gauge_setter(plain.labels("a")) == plain.labels("a").set


class _Record:
    """A lone request's record (no task or workflow id), as CostLedger.record reads it."""

    def __init__(self, request_id: str, outcome: str, ts: float) -> None:
        self.ts = ts
        self.request_id = request_id
        self.tenant = "t"
        self.model = "m"
        self.pool = "p"
        self.endpoint = "http://e:1"
        self.e2e_s = 0.5
        self.task_id = None
        self.workflow_id = None
        self.step = None
        self.steps_in_task = None
        self.final = None
        self.gpu = "H100"
        self.outcome = outcome
        self.prompt_tokens = 100
        self.cached_tokens = 10
        self.completion_tokens = 20
        self.gpu_seconds = None
        self.attempts = ()


@pytest.mark.parametrize("outcome", ["ok", "upstream_error", "client_disconnect"])
def test_lone_task_result_as_keyword_built(outcome: str) -> None:
    ledger = CostLedger()
    record = _Record("r1", outcome, 10.0)
    costs = ledger.attempt_costs(record)
    (task,) = ledger.record(record, costs)
    usd = costs[0].usd
    ok = outcome == "ok"
    want = TaskResult(
        key="request:r1",
        tenant="t",
        model="m",
        succeeded=ok,
        requests=1,
        cost_usd=usd,
        wasted_usd=0.0 if ok else usd,
        first_ts=10.0,
        last_ts=10.0,
        reason="final_ok" if ok else "final",
        pool="p",
        settled_usd=usd if ok else 0,
    )
    assert type(task) is TaskResult
    assert task == want and task.succeeded is ok
    assert [type(v) for v in task] == [type(v) for v in want]


class _Unshared(CostLedger):
    """The ledger as it was: every record moves three figures objects (the reference)."""

    def _slices(self, tenant: str, model: str) -> tuple:  # type: ignore[type-arg]
        by_tenant = self._tenants.get(tenant)
        if by_tenant is None:
            by_tenant = self._tenants[tenant] = type(self._total)()
        by_model = self._models.get(model)
        if by_model is None:
            by_model = self._models[model] = type(self._total)()
        return self._total, by_tenant, by_model


_records = st.lists(
    st.tuples(
        st.sampled_from(["t", "t", "t", "u", None]),  # tenant (None: "-")
        st.sampled_from(["m", "m", "m", "n"]),  # model
        st.sampled_from([None, None, "task-1", "task-2"]),  # task id
        st.sampled_from(["ok", "ok", "upstream_error", "client_disconnect"]),
        st.integers(0, 5000),  # prompt tokens
        st.integers(0, 500),  # completion tokens
        st.sampled_from([None, True, False]),  # final
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(records=_records)
def test_one_tenant_and_model_figures_shared_as_three(records: list[tuple]) -> None:  # type: ignore[type-arg]
    """While one tenant and one model came, the total's figures serve as theirs; after
    another comes, every summary and closed task is the unshared ledger's, to the bit."""
    ledger, reference = CostLedger(max_open_tasks=3), _Unshared(max_open_tasks=3)
    for i, (tenant, model, task, outcome, prompt, completion, final) in enumerate(records):
        rec = _Record(f"r{i}", outcome, 10.0 + i)
        rec.tenant, rec.model, rec.task_id, rec.final = tenant, model, task, final
        rec.prompt_tokens, rec.completion_tokens = prompt, completion
        assert ledger.record(rec) == reference.record(rec)
        assert ledger.summary() == reference.summary()
    assert ledger.close_all() == reference.close_all()
    assert ledger.summary() == reference.summary()
    summary = ledger.summary()
    assert sum(f.requests for f in summary.by_tenant.values()) == summary.total.requests


@pytest.mark.parametrize("reading", [REPORTED, MEASURED, ESTIMATED, NO_WORK])
@pytest.mark.parametrize("engine_seconds", [None, 2.5])
def test_one_attempt_settled_as_the_loop(reading: str, engine_seconds: float | None) -> None:
    """RequestTrace.settled's one-attempt path leaves what its loop over attempts left."""
    from filters.request import parse_inference_request
    from meshd.observe import RequestObserver

    observer = RequestObserver(DataPlaneMetrics())
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    inference = parse_inference_request("chat", body)
    req = observer.begin("chat", "default", inference, None, "r", 0.0)
    a = req.attempt("http://e:1", "H100", 0.0)
    a.end("ok", 200, 0, 10, 5, 1.0, gpu_seconds=engine_seconds)
    cost = AttemptCost(3, 0.25, reading, 1.0, 0.1)  # an int's seconds: made a float
    req.outcome = "ok"
    req.settled([cost], [], None, 1.0)
    # The loop's answer, written out: sums from 0.0, the least certain reading named.
    want_source = next((r for r in (ESTIMATED, MEASURED) if r in {reading}), REPORTED)
    assert (req.gpu_seconds, req.cost_usd, req.gpu_seconds_source) == (3.0, 0.25, want_source)
    assert type(req.gpu_seconds) is float
    if reading == MEASURED and engine_seconds is None:
        assert (a.gpu_seconds, a.gpu_seconds_source) == (3, MEASURED)
    else:
        assert a.gpu_seconds == engine_seconds
