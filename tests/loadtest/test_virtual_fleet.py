"""The engine fleet on a virtual clock (loadtest/engine/virtual.py): the same replica as
the HTTP simulator, driven by events; faults reach requests as they would over HTTP."""

from __future__ import annotations

import json

import pytest
from sim_helpers import make_core

from loadtest.engine import EngineSpec
from loadtest.engine.core import SimRequest, run_until_idle
from loadtest.engine.faults import parse_fault
from loadtest.engine.kv_events import AllBlocksCleared, BlockStored, KVEvent
from loadtest.engine.replica import EngineReplica
from loadtest.engine.virtual import (
    CONNECT_REFUSED,
    Accepted,
    Refused,
    VirtualEngine,
    VirtualFleet,
)


class Recorder:
    """A Stream that remembers what it heard."""

    def __init__(self) -> None:
        self.token_times: list[tuple[int, float]] = []
        self.finished_at: float | None = None
        self.reset: tuple[int, float] | None = None

    def on_tokens(self, engine: VirtualEngine, req: SimRequest, now: float) -> None:
        self.token_times.append((req.num_output_tokens, now))
        if req.finished:
            self.finished_at = now

    def on_reset(self, engine: VirtualEngine, req: SimRequest, delivered: int, now: float) -> None:
        self.reset = (delivered, now)


def body(prompt: str, max_tokens: int = 8) -> bytes:
    return json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    ).encode()


def drain(fleet: VirtualFleet, limit: int = 100_000) -> None:
    for _ in range(limit):
        if fleet.run_next() is None:
            return
    raise AssertionError("the fleet did not go idle")


PROMPT = " ".join(f"word{i}" for i in range(200))


def test_a_request_runs_the_same_steps_as_a_bare_core() -> None:
    fleet = VirtualFleet([EngineSpec(gpu="A100")])
    rec = Recorder()
    result = fleet[0].submit("completion", body(PROMPT, 12), "r1", 0.0, rec)
    assert isinstance(result, Accepted)
    drain(fleet)
    # The reference: the same prompt ids straight into an EngineCore on run_until_idle.
    replica = EngineReplica(EngineSpec(gpu="A100"))
    parsed = replica.parse("completion", json.loads(body(PROMPT, 12)))
    core = make_core("A100")
    ref = SimRequest("ref", parsed.prompt_ids, 12, ignore_eos=True)
    core.submit(ref, 0.0)
    run_until_idle(core)
    assert result.req.output_text() == ref.output_text()
    assert result.req.first_token_time == pytest.approx(ref.first_token_time)
    assert rec.finished_at == pytest.approx(ref.finish_time)
    assert [n for n, _ in rec.token_times] == list(range(1, 13))
    assert fleet.next_event_time() is None


def test_engines_interleave_in_time_order() -> None:
    fleet = VirtualFleet([EngineSpec(gpu="A100"), EngineSpec(gpu="B200")])
    recs = [Recorder(), Recorder()]
    for i in (0, 1):
        assert isinstance(
            fleet[i].submit("completion", body(PROMPT), f"r{i}", 0.0, recs[i]), Accepted
        )
    times = []
    while (t := fleet.run_next()) is not None:
        times.append(t)
    assert times == sorted(times)
    # The B200 is faster: it finishes first, on its own timeline.
    assert recs[1].finished_at is not None and recs[0].finished_at is not None
    assert recs[1].finished_at < recs[0].finished_at


def test_crash_after_tokens_resets_after_n_tokens() -> None:
    fleet = VirtualFleet([EngineSpec()])
    fleet[0].inject(parse_fault({"kind": "crash_after_tokens", "tokens": 3}), 0.0)
    rec, rec2 = Recorder(), Recorder()
    fleet[0].submit("completion", body(PROMPT, 10), "r1", 0.0, rec)
    drain(fleet)
    assert rec.reset is not None and rec.reset[0] == 3
    assert rec.finished_at is None
    # count 1: the next request is served in full.
    fleet[0].submit("completion", body(PROMPT, 10), "r2", fleet.now, rec2)
    drain(fleet)
    assert rec2.reset is None and rec2.token_times[-1][0] == 10


def test_status_burst_and_loading_refuse_at_the_door() -> None:
    fleet = VirtualFleet(
        [EngineSpec(cold_start_s=5.0), EngineSpec(cold_start_s=5.0, cold_start_mode="unavailable")]
    )
    refused = fleet[0].submit("completion", body(PROMPT), "a", 1.0, Recorder())
    assert isinstance(refused, Refused) and refused.status == CONNECT_REFUSED
    unavailable = fleet[1].submit("completion", body(PROMPT), "b", 1.0, Recorder())
    assert isinstance(unavailable, Refused) and unavailable.status == 503
    # Loaded at 5 s: served.
    assert isinstance(fleet[0].submit("completion", body(PROMPT), "c", 5.0, Recorder()), Accepted)
    fleet[1].inject(
        parse_fault({"kind": "status_burst", "status": 429, "count": 1, "retry_after": 2}), 6.0
    )
    burst = fleet[1].submit("completion", body(PROMPT), "d", 6.0, Recorder())
    assert isinstance(burst, Refused) and (burst.status, burst.retry_after) == (429, 2)
    assert isinstance(fleet[1].submit("completion", body(PROMPT), "e", 6.0, Recorder()), Accepted)
    bad = fleet[1].submit("completion", b"{not json", "f", 6.0, Recorder())
    assert isinstance(bad, Refused) and bad.status == 400


def test_restart_resets_streams_and_clears_the_cache() -> None:
    events: list[KVEvent] = []
    fleet = VirtualFleet([EngineSpec()], kv_event_sink=lambda e, evs, now: events.extend(evs))
    rec = Recorder()
    fleet[0].submit("completion", body(PROMPT, 50), "r1", 0.0, rec)
    fleet.schedule(0, parse_fault({"kind": "restart", "cold_start_seconds": 2, "at": 0.1}))
    drain(fleet)
    assert rec.reset is not None and rec.reset[1] == pytest.approx(0.1)
    assert 0 < rec.reset[0] < 50
    assert any(isinstance(e, BlockStored) for e in events)
    assert isinstance(events[-1], AllBlocksCleared)
    refused = fleet[0].submit("completion", body(PROMPT), "r2", 1.0, Recorder())
    assert isinstance(refused, Refused) and refused.status == CONNECT_REFUSED


def test_slowdown_and_hang_stretch_the_timeline() -> None:
    def finish(fault: dict[str, object] | None) -> float:
        fleet = VirtualFleet([EngineSpec()])
        if fault is not None:
            fleet[0].inject(parse_fault(fault), 0.0)
        rec = Recorder()
        fleet[0].submit("completion", body(PROMPT, 20), "r", 0.0, rec)
        drain(fleet)
        assert rec.finished_at is not None
        return rec.finished_at

    base = finish(None)
    assert finish({"kind": "slowdown", "factor": 3}) == pytest.approx(3 * base)
    assert finish({"kind": "hang", "seconds": 4}) == pytest.approx(base + 4, rel=1e-3)


def test_abort_frees_the_engine() -> None:
    fleet = VirtualFleet([EngineSpec()])
    rec = Recorder()
    result = fleet[0].submit("completion", body(PROMPT, 1000), "r", 0.0, rec)
    assert isinstance(result, Accepted)
    fleet.run_until(0.05)
    fleet[0].abort(result.req, fleet.now)
    assert fleet[0].in_flight == 0
    assert fleet.next_event_time() is None or fleet[0].core.num_running == 0
    drain(fleet)
    assert rec.finished_at is None and result.req.finish_reason == "abort"
