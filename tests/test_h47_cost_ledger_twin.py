"""The ledger's compiled per-record path (filters/_cost_ledger_c.pyx) against its
pure-Python reference (filters/cost_ledger.py's *_reference): over random records with
attempts, engine figures, busy-time readings, tasks and lone requests, the same costs,
tickets, closed tasks and summaries, to the bit (issue #22)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import filters.cost_ledger as cl
from filters.busy_time import BusyApportioner
from filters.cost_ledger import CostLedger, PriceTable, TimingModel
from filters.gpu import GpuTable

pytestmark = pytest.mark.skipif(
    cl.IMPLEMENTATION != "cython", reason=f"compiled ledger not in use: {cl.IMPLEMENTATION}"
)


class _Reference(CostLedger):
    attempt_costs = cl.attempt_costs_reference  # type: ignore[assignment]
    track = cl.track_reference  # type: ignore[assignment]
    record = cl.record_reference  # type: ignore[assignment]


@dataclass
class _Attempt:
    endpoint: str
    gpu: str | None
    outcome: str
    completion_tokens: int | None
    cached_tokens: int | None
    gpu_seconds: float | None
    gpu_seconds_source: str | None
    reason: str
    started_ts: float | None
    first_token_ts: float | None
    ended_ts: float | None


@dataclass
class _Record:
    ts: float
    request_id: str
    tenant: str | None
    model: str | None
    pool: str | None
    endpoint: str | None
    e2e_s: float | None
    task_id: str | None
    workflow_id: str | None
    step: int | None
    steps_in_task: int | None
    final: bool | None
    gpu: str | None
    outcome: str
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    gpu_seconds: float | None
    attempts: tuple[_Attempt, ...]


_ENDPOINTS = ["http://a:1", "http://b:1", "http://c:1"]
_GPUS = [None, "", "H100", "NVIDIA A100-SXM4-80GB", "L40S", "B200"]
_OUTCOMES = ["ok", "ok", "upstream_error", "client_disconnect", "connect_error", "not_sent"]
_tokens = st.one_of(st.none(), st.integers(0, 3000))
_seconds = st.one_of(st.none(), st.floats(0.0, 5.0), st.just(0.0))

_attempts = st.builds(
    _Attempt,
    endpoint=st.sampled_from(_ENDPOINTS),
    gpu=st.sampled_from(_GPUS),
    outcome=st.sampled_from(_OUTCOMES),
    completion_tokens=_tokens,
    cached_tokens=_tokens,
    gpu_seconds=_seconds,
    gpu_seconds_source=st.sampled_from([None, "measured", "reported"]),
    reason=st.sampled_from(["", "", "prefill", "resume", "connect_error"]),
    started_ts=st.one_of(st.none(), st.floats(0.0, 50.0)),
    first_token_ts=st.one_of(st.none(), st.floats(0.0, 50.0)),
    ended_ts=st.one_of(st.none(), st.floats(0.0, 60.0)),
)


@st.composite
def _records(draw: st.DrawFn) -> list[_Record]:
    out = []
    for i in range(draw(st.integers(0, 25))):
        out.append(
            _Record(
                ts=10.0 + i * draw(st.sampled_from([0.5, 100.0, 400.0])),
                request_id=f"r{i}",
                tenant=draw(st.sampled_from(["t", "t", "u", None])),
                model=draw(st.sampled_from(["m", "m", "n", None])),
                pool=draw(st.sampled_from(["p", None])),
                endpoint=draw(st.sampled_from([*_ENDPOINTS, None])),
                e2e_s=draw(st.one_of(st.none(), st.floats(-1.0, 30.0))),
                task_id=draw(st.sampled_from([None, None, "k1", "k2"])),
                workflow_id=draw(st.sampled_from([None, None, "w1"])),
                step=draw(st.one_of(st.none(), st.integers(0, 4))),
                steps_in_task=draw(st.one_of(st.none(), st.integers(1, 4))),
                final=draw(st.sampled_from([None, None, True, False])),
                gpu=draw(st.sampled_from(_GPUS)),
                outcome=draw(st.sampled_from(_OUTCOMES)),
                prompt_tokens=draw(_tokens),
                cached_tokens=draw(_tokens),
                completion_tokens=draw(_tokens),
                gpu_seconds=draw(_seconds),
                attempts=tuple(draw(st.lists(_attempts, max_size=3))),
            )
        )
    return out


def _busy(readings: list[tuple[int, float, float]]) -> BusyApportioner:
    busy = BusyApportioner()
    for endpoint, at, busy_s in readings:
        busy.reading(_ENDPOINTS[endpoint], at, busy_s, None)
    return busy


@settings(max_examples=60, deadline=None)
@given(
    records=_records(),
    readings=st.lists(
        st.tuples(st.integers(0, 2), st.floats(0.0, 100.0), st.floats(0.0, 50.0)), max_size=6
    ),
    fleet=st.booleans(),
    batch=st.sampled_from([32, 1, 0, 200]),
)
def test_compiled_record_path_equals_reference(
    records: list[_Record], readings: list[tuple[int, float, float]], fleet: bool, batch: int
) -> None:
    kw = {
        "prices": PriceTable({"L40S": 1.5}),
        "timing": TimingModel(GpuTable({"H100": {"decode_step_s_b64": 0.005}}), batch),
        "max_open_tasks": 2,
        "idle_timeout_s": 300.0,
        "fleet": {_ENDPOINTS[0]: "H100"} if fleet else None,
    }
    ledger = CostLedger(busy=_busy(readings), **kw)  # type: ignore[arg-type]
    reference = _Reference(busy=_busy(readings), **kw)  # type: ignore[arg-type]
    for rec in records:
        costs = ledger.attempt_costs(rec)
        assert repr(costs) == repr(reference.attempt_costs(rec))
        tickets = ledger.track(rec, costs)
        assert repr(tickets) == repr(reference.track(rec, costs))
        assert repr(ledger.record(rec, costs, tracked=True)) == repr(
            reference.record(rec, costs, tracked=True)
        )
        assert repr(ledger.record(rec)) == repr(reference.record(rec))  # untracked, own costs
    assert repr(ledger.summary()) == repr(reference.summary())
    assert repr(ledger.close_all()) == repr(reference.close_all())
    assert repr(ledger.summary()) == repr(reference.summary())


def test_bound_as_the_methods() -> None:
    assert CostLedger.record is not cl.record_reference
    assert CostLedger.attempt_costs is not cl.attempt_costs_reference
    assert CostLedger.track is not cl.track_reference
