"""filters/busy_time.py and the cost ledger's measured reading: an engine's busy seconds
apportioned to the sidecar's attempts by their modelled share, once every attempt that ran in
a window is over; the batch model where no engine said; the reading named per attempt, in
the access log and in the ledger's summary."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from filters.busy_time import BusyApportioner
from filters.cost_ledger import (
    ESTIMATED,
    MEASURED,
    REPORTED,
    CostLedger,
    PriceTable,
)
from filters.request import parse_inference_request
from filters.vllm_metrics import parse_vllm
from loadtest.engine.stats import EngineStats, render_metrics
from meshd import cost_cmd
from meshd.access_log import AccessLogWriter, AccessRecord, AttemptRecord, read_access_log
from meshd.metrics import DataPlaneMetrics
from meshd.observe import RequestObserver

A = "http://10.0.0.1:8000"
PRICES = PriceTable({"H100": 3.6})  # $0.001 a GPU-second


def work(b: BusyApportioner, start: float, end: float, seconds: float, tokens: float) -> None:
    b.work(A, start, end, decode_s=seconds, output_tokens=tokens, tracked=False)


def test_busy_seconds_are_split_by_the_models_share_of_settled_work() -> None:
    b = BusyApportioner()
    b.reading(A, 0.0, 100.0, 1000.0)
    assert b.factor(A) is None  # one reading: no window yet
    work(b, 0.2, 0.8, 1.0, 50)
    b.reading(A, 1.0, 104.0, 1100.0)  # 4 busy s, 100 tokens in [0, 1]
    work(b, 0.5, 1.5, 2.0, 50)  # ends after that reading: half of it in [0, 1]
    # [0, 1] holds 1.0 + 1.0 modelled seconds and 50 + 25 own tokens of the engine's 100.
    assert b.factor(A) == pytest.approx(4.0 * 0.75 / 2.0)


def test_a_window_waits_for_the_attempts_that_ran_in_it() -> None:
    b = BusyApportioner()
    b.reading(A, 0.0, 0.0)
    b.started(A, 0.5)
    b.reading(A, 1.0, 3.0)
    assert b.factor(A) is None  # the attempt begun at 0.5 is still running
    b.work(A, 0.5, 0.9, decode_s=1.5)
    assert b.factor(A) == pytest.approx(2.0)
    b.started(A, 1.2)
    b.reading(A, 2.0, 13.0)
    assert b.factor(A) == pytest.approx(2.0)  # [1, 2] not settled: its attempt runs on
    b.work(A, 1.2, 1.8, decode_s=5.0)
    assert b.factor(A) == pytest.approx(13.0 / 6.5)


def test_the_prefill_is_spread_before_the_first_token_and_the_decode_after() -> None:
    b = BusyApportioner()
    b.reading(A, 0.0, 0.0, 0.0)
    b.reading(A, 1.0, 3.0, 100.0)
    b.reading(A, 2.0, 4.0, 110.0)
    b.work(A, 0.0, 2.0, prefill_s=3.0, decode_s=1.0, prompt_tokens=100, output_tokens=10,
           first_token=1.0, tracked=False)  # fmt: skip
    assert b.factor(A) == pytest.approx(1.0)  # 4 busy s for 4 modelled, tokens all its own


def test_another_clients_tokens_take_their_share_of_the_busy_time() -> None:
    b = BusyApportioner()
    b.reading(A, 0.0, 0.0, 0.0)
    work(b, 0.0, 1.0, 1.0, 100)
    b.reading(A, 1.0, 4.0, 400.0)  # the engine made 400 tokens, 100 of them ours
    assert b.factor(A) == pytest.approx(1.0)
    c = BusyApportioner()  # an engine without token counters: all its busy time is ours
    c.reading(A, 0.0, 0.0)
    c.work(A, 0.0, 1.0, decode_s=1.0, output_tokens=100, tracked=False)
    c.reading(A, 1.0, 4.0)
    assert c.factor(A) == pytest.approx(4.0)


def test_a_counter_that_went_back_starts_over_and_old_windows_leave_the_horizon() -> None:
    b = BusyApportioner(horizon_s=10.0)
    b.reading(A, 0.0, 50.0)
    work(b, 0.0, 1.0, 1.0, 0)
    b.reading(A, 1.0, 52.0)
    assert b.factor(A) == pytest.approx(2.0)
    b.reading(A, 2.0, 1.0)  # the engine restarted
    assert b.factor(A) is None and b.resets == 1
    work(b, 2.0, 3.0, 1.0, 0)
    b.reading(A, 3.0, 4.0)
    assert b.factor(A) == pytest.approx(3.0)
    work(b, 3.0, 4.0, 1.0, 0)
    b.reading(A, 4.0, 5.0)
    assert b.factor(A) == pytest.approx(2.0)  # (3 + 1) / 2
    b.reading(A, 13.5, 5.0)  # [2, 3] is past the 10 s horizon now
    assert b.factor(A) == pytest.approx(1.0)


def test_readings_past_the_endpoint_limit_are_ignored() -> None:
    b = BusyApportioner(max_endpoints=1)
    b.reading(A, 0.0, 0.0)
    b.reading("http://other", 0.0, 0.0)
    assert b.endpoints == 1 and b.ignored_readings == 1
    b.reading(A, 1.0, float("nan"))  # not a reading
    assert b.factor(A) is None


def test_the_ledger_charges_measured_time_and_keeps_the_model_beside() -> None:
    busy = BusyApportioner()
    ledger = CostLedger(PRICES, busy=busy)
    modelled = ledger.timing.gpu_seconds("H100", 1000, 0, 100)

    def one(ts: float, rid: str) -> AccessRecord:
        return AccessRecord(ts=ts, request_id=rid, outcome="ok", gpu="H100", e2e_s=0.5,
                            prompt_tokens=1000, completion_tokens=100,
                            attempts=(AttemptRecord(A, "ok", gpu="H100"),))  # fmt: skip

    busy.reading(A, 0.0, 0.0, 0.0)
    first = ledger.attempt_costs(one(0.2, "r1"))
    assert first[0].reading == ESTIMATED and first[0].seconds == pytest.approx(modelled)
    ledger.record(one(0.2, "r1"), first)
    busy.reading(A, 1.0, 3.0 * modelled, 1100.0)  # the engine was busy 3x the model's guess
    second = ledger.attempt_costs(one(1.2, "r2"))
    assert second[0].reading == MEASURED
    assert second[0].seconds == pytest.approx(3.0 * modelled)
    assert second[0].modelled_s == pytest.approx(modelled)
    ledger.record(one(1.2, "r2"), second)
    s = ledger.summary()
    assert s.total.cost_usd == pytest.approx(4.0 * modelled * 0.001)
    assert s.total.modelled_usd == pytest.approx(2.0 * modelled * 0.001)
    assert s.readings[MEASURED].attempts == 1 and s.readings[ESTIMATED].attempts == 1
    assert s.measured_share == pytest.approx(0.75)
    assert s.estimated_requests == 1


def test_a_logged_measured_attempt_is_read_back_as_measured() -> None:
    ledger = CostLedger(PRICES)
    attempts = (AttemptRecord(A, "ok", gpu="H100", gpu_seconds=2.0, gpu_seconds_source=MEASURED),)
    ledger.record(AccessRecord(ts=0.0, request_id="r", outcome="ok", gpu="H100",
                               prompt_tokens=1000, completion_tokens=100,
                               attempts=attempts))  # fmt: skip
    orca = (AttemptRecord(A, "ok", gpu="H100", gpu_seconds=1.0),)
    ledger.record(AccessRecord(ts=1.0, request_id="q", outcome="ok", gpu="H100", attempts=orca))
    s = ledger.summary()
    assert s.readings[MEASURED].usd == pytest.approx(0.002)
    assert s.readings[REPORTED].usd == pytest.approx(0.001)
    assert s.estimated_requests == 0 and s.measured_share == 1.0
    line = cost_cmd.readings_line(s)  # `meshd cost` says which reading the spend is
    assert "33% reported by the engine" in line and "67% the engine's measured busy" in line


def test_the_simulators_busy_counter_is_read_from_its_page() -> None:
    stats = EngineStats(max_model_len=4096)
    stats.prompt_tokens, stats.generation_tokens = 1000, 64
    text = render_metrics(stats, model_name="m", engine="0", running=0, waiting=0,
                          waiting_capacity=0, kv_cache_usage=0.0, cache_config={},
                          busy_seconds=12.5)  # fmt: skip
    m = parse_vllm(text)
    assert m.busy_seconds == 12.5 and m.tokens == 1064
    bare = render_metrics(stats, model_name="m", engine="0", running=0, waiting=0,
                          waiting_capacity=0, kv_cache_usage=0.0, cache_config={})  # fmt: skip
    assert parse_vllm(bare).busy_seconds is None  # a vLLM's page: no busy reading


def test_the_sidecar_prices_a_request_once_its_windows_settle_and_logs_the_reading(
    tmp_path: Path,
) -> None:
    path = tmp_path / "access.jsonl"
    observer = RequestObserver(DataPlaneMetrics(), access_log=AccessLogWriter(path))
    body = b'{"model":"m","stream":true,"max_tokens":64,"prompt":"hello"}'
    t0 = time.monotonic()

    def request(rid: str, at: float, engine: str = A) -> None:
        req = observer.begin("completion", "default", parse_inference_request("completion", body),
                             None, rid, at)  # fmt: skip
        a = req.attempt(engine, "H100", at)
        a.first_token(at + 0.1)
        a.end("ok", 200, 0, 600, 64, at + 0.4)
        req.finish("ok", {"prompt_tokens": 600, "completion_tokens": 64}, at + 0.4, status=200)

    request("r0", t0 - 1.0, "http://no-reading")  # an engine that gave none: the model's
    observer.engine_busy(A, t0, 0.0, 0.0)
    request("r1", t0 + 0.1)
    observer.tick(t0 + 0.5)
    assert observer.ledger.summary().total.requests == 1  # r1 waits for its window
    observer.engine_busy(A, t0 + 1.0, 2.0, 664.0)
    observer.tick(t0 + 1.05)  # [t0, t0 + 1] settled: r1 gets its busy time
    request("r2", t0 + 1.1)
    observer.close()  # r2's window never closed: the horizon's factor, at the close
    zero, first, second = read_access_log(path)
    assert zero.gpu_seconds_source == ESTIMATED and zero.attempts[0].gpu_seconds is None
    assert first.gpu_seconds_source == MEASURED == first.attempts[0].gpu_seconds_source
    assert first.attempts[0].gpu_seconds == pytest.approx(2.0)  # all of [t0, t0 + 1]
    assert second.gpu_seconds_source == MEASURED
    assert second.attempts[0].gpu_seconds == pytest.approx(2.0)  # r1's ratio, r2's model
    replay = CostLedger()
    replay.record_all([zero, first, second])
    total = zero.cost_usd + first.cost_usd + second.cost_usd
    assert replay.summary().total.cost_usd == pytest.approx(total)


def test_each_attempt_gets_the_busy_time_of_its_own_windows() -> None:
    b = BusyApportioner()
    b.reading(A, 0.0, 0.0)
    b.started(A, 0.1)
    b.started(A, 0.2)
    b.started(A, 1.1)
    b.reading(A, 1.0, 3.0)  # [0, 1]: 3 busy s
    early = b.work(A, 0.1, 0.9, decode_s=1.0)
    small = b.work(A, 0.2, 0.9, decode_s=0.5)
    b.reading(A, 2.0, 3.5)  # [1, 2]: 0.5 busy s
    late = b.work(A, 1.1, 1.9, decode_s=1.0)
    assert early is not None and small is not None and late is not None
    assert b.ready(early) and b.ready(late)
    # [0, 1]'s 3 s split 1 : 0.5; [1, 2]'s 0.5 s all the late one's: not one ratio for all.
    assert b.charge(early) == pytest.approx(2.0) and b.charge(small) == pytest.approx(1.0)
    assert b.charge(late) == pytest.approx(0.5)
    assert b.factor(A) == pytest.approx(3.5 / 2.5)
    b.started(A, 2.5)
    waiting = b.work(A, 2.1, 2.9, decode_s=1.0)  # past the last reading: the open window
    assert waiting is not None and not b.ready(waiting) and b.charge(waiting) is None
    b.reading(A, 3.0, 4.5)
    assert not b.ready(waiting)  # the attempt begun at 2.5 still runs
    b.work(A, 2.5, 2.6, decode_s=0.0)
    assert b.ready(waiting) and b.charge(waiting) == pytest.approx(1.0)
    b.started(A, 3.1)
    lost = b.work(A, 3.05, 3.5, decode_s=1.0)
    b.reading(A, 4.0, 0.5)  # the engine restarted: the open window is void
    assert lost is not None and b.ready(lost) and b.charge(lost) is None


def test_an_attempt_is_found_again_when_the_wall_clock_offset_moves() -> None:
    observer = RequestObserver(DataPlaneMetrics())
    body = b'{"model":"m","stream":true,"max_tokens":64,"prompt":"hello"}'
    observer.engine_busy(A, 100.0, 0.0, None)
    req = observer.begin("completion", "default", parse_inference_request("completion", body),
                         None, "r", 100.1)  # fmt: skip
    a = req.attempt(A, "H100", 100.1)
    observer._wall_offset += 0.25e-6  # what tick()'s re-read of the wall clock does
    a.end("ok", 200, 0, 600, 64, 100.4)
    req.finish("ok", {"prompt_tokens": 600, "completion_tokens": 64}, 100.4, status=200)
    observer.engine_busy(A, 101.0, 2.0, None)
    busy = observer.ledger.busy
    assert busy is not None and busy.factor(A) is not None  # its window settled: it ended
