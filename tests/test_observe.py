"""meshd/observe.py: a request driven through RequestObserver arrives at a real OTLP/gRPC
receiver (tests/otlp_receiver.py) as server -> queue, pick, upstream x2 -> stream spans with
GenAI attributes; its access-log lines, read back by `meshd cost`, give the cost per
successful task computed by hand; and the metrics move."""

from __future__ import annotations

import contextlib
import io
import re
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from otlp_receiver import OtlpReceiver
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from filters.hotpath import parse_routing_headers
from filters.pool_router import Route
from filters.request import parse_inference_request
from meshd import cost_cmd
from meshd import telemetry as t
from meshd.access_log import AccessLogWriter, read_access_log
from meshd.config import load_config
from meshd.metrics import DataPlaneMetrics
from meshd.observe import BoundedLabels, RequestObserver, counter_adder

MODEL = "llama-3-8b"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
H100_PER_S = 3.0 / 3600  # the default price table's H100


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def body(stream: bool = True) -> bytes:
    s = "true" if stream else "false"
    return (
        f'{{"model":"{MODEL}","stream":{s},"max_tokens":64,'
        '"messages":[{"role":"user","content":"hello"}]}'
    ).encode()


def routing(*pairs: tuple[str, str]):  # type: ignore[no-untyped-def]
    r, _ = parse_routing_headers(list(pairs), True)
    assert not r.errors
    return r


def samples(m: DataPlaneMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: DataPlaneMetrics, name: str, **labels: str) -> float:
    return samples(m).get((name, frozenset(labels.items())), 0.0)


def streamed_request_with_retry(
    observer: RequestObserver, now: float, headers: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """What the sidecar does for a streamed chat request whose first attempt cannot
    connect; returns the headers the second attempt sent upstream."""
    inference = parse_inference_request("chat", body())
    req = observer.begin("chat", "default", inference, routing(*headers), "r-1", now)
    req.admitted(now, now + 0.002)
    routes = [Route(A, "most cached prefix", 0.05, 512.0), Route(B, "next best", 0.09, 0.0)]
    req.picked(routes, now + 0.003, started=now + 0.002)
    first = req.attempt(A, "H100", now + 0.003)
    first.inject_headers([("x-request-id", "r-1")])
    first.end("connect_error", 0, None, None, None, now + 0.004, error="connection refused")
    second = req.attempt(B, "H100", now + 0.005, reason="connect_error")
    sent = second.inject_headers([("x-request-id", "r-1"), ("traceparent", "stale")])
    second.response(200, now + 0.01)
    second.first_token(now + 0.07)
    second.end("ok", 200, 512, 600, 64, now + 0.7)  # the figures of the stream's usage
    usage = {"prompt_tokens": 600, "completion_tokens": 64}
    req.finish("ok", usage, now + 0.7, status=200, finish_reasons=["length"])
    return sent


# ---------------------------------------------------------------- spans, for real


def test_request_arrives_as_server_and_client_spans(receiver: OtlpReceiver) -> None:
    provider = t.setup_tracing("meshd-sidecar", receiver.endpoint, 1.0)
    observer = RequestObserver(DataPlaneMetrics(), tracer_provider=provider)
    sent = streamed_request_with_retry(observer, time.monotonic(), [("x-meshd-tenant", "acme")])
    observer.close()  # flushes the batch processor
    spans = receiver.wait_for(6)
    by = receiver.by_name()
    assert sorted(by) == sorted(
        [f"chat {MODEL}", t.SPAN_QUEUE, t.SPAN_PICK, t.SPAN_ATTEMPT, t.SPAN_STREAM]
    )
    (server,) = by[f"chat {MODEL}"]
    assert server.parent_span_id == "" and server.kind == 2  # SERVER
    assert {s.trace_id for s in spans} == {server.trace_id}
    attrs = server.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "openai"
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.request.stream"] is True
    assert attrs["gen_ai.request.max_tokens"] == 64
    assert attrs["gen_ai.usage.input_tokens"] == 600
    assert attrs["gen_ai.usage.output_tokens"] == 64
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 512
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.response.time_to_first_chunk"] == pytest.approx(0.07)
    assert attrs[t.ATTR_TENANT] == "acme"
    assert attrs[t.ATTR_OUTCOME] == "ok" and attrs[t.ATTR_ATTEMPTS] == 2
    assert attrs[t.HTTP_RESPONSE_STATUS_CODE] == 200
    assert attrs[t.ATTR_COST_USD] > 0
    assert server.end_ns - server.start_ns == pytest.approx(0.7e9, rel=1e-3)

    (queue,) = by[t.SPAN_QUEUE]
    (pick,) = by[t.SPAN_PICK]
    assert queue.parent_span_id == pick.parent_span_id == server.span_id
    assert pick.attributes[t.ATTR_ENDPOINT] == A
    assert pick.attributes[t.ATTR_PREDICTED_CACHED_TOKENS] == 512
    assert pick.attributes[t.ATTR_RUNNER_UP] == B
    assert pick.attributes[t.ATTR_RUNNER_UP_REASON] == "next best"

    attempts = sorted(by[t.SPAN_ATTEMPT], key=lambda s: s.attributes[t.ATTR_ATTEMPT])
    assert [a.parent_span_id for a in attempts] == [server.span_id] * 2
    assert [a.kind for a in attempts] == [3, 3]  # CLIENT
    assert attempts[0].attributes[t.ERROR_TYPE] == "connect_error"
    assert attempts[0].attributes[t.ATTR_PREDICTED_CACHED_TOKENS] == 512  # from the pick
    assert attempts[1].attributes[t.ATTR_RETRY_REASON] == "connect_error"
    assert attempts[1].attributes[t.SERVER_ADDRESS] == "10.0.0.2"
    assert attempts[1].attributes[t.SERVER_PORT] == 8000
    assert attempts[1].attributes["gen_ai.usage.cache_read.input_tokens"] == 512
    assert t.ERROR_TYPE not in attempts[1].attributes
    (stream,) = by[t.SPAN_STREAM]
    assert stream.parent_span_id == attempts[1].span_id
    assert [e[0] for e in stream.events] == [t.EVENT_FIRST_TOKEN]
    # The engine is told the second attempt is its parent; the stale header is gone.
    (tp,) = [v for k, v in sent if k == "traceparent"]
    assert tp.startswith(f"00-{server.trace_id}-{attempts[1].span_id}-")


def test_client_traceparent_is_continued(receiver: OtlpReceiver) -> None:
    provider = t.setup_tracing("meshd-sidecar", receiver.endpoint, 0.0)  # parent wins
    observer = RequestObserver(DataPlaneMetrics(), tracer_provider=provider)
    tp = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
    streamed_request_with_retry(observer, time.monotonic(), [("traceparent", tp)])
    observer.close()
    spans = receiver.wait_for(6)
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    (server,) = receiver.by_name()[f"chat {MODEL}"]
    assert server.parent_span_id == CLIENT_PARENT


def test_tracing_off_makes_no_spans_and_leaves_headers_alone() -> None:
    observer = RequestObserver(DataPlaneMetrics())
    tp = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
    inference = parse_inference_request("chat", body())
    req = observer.begin("chat", "default", inference, routing(("traceparent", tp)), "r", 0.0)
    a = req.attempt(A, None, 0.0)
    headers = [("traceparent", tp)]
    assert a.inject_headers(headers) is headers
    assert a.traceparent() is None and req.span is None
    req.finish("ok", None, 1.0, status=200)
    assert req.trace_id == CLIENT_TRACE  # the access log still names the client's trace


# ---------------------------------------------------------------- the access log and `meshd cost`


def run_tasks(observer: RequestObserver, t0: float) -> None:
    """Two tasks with engine-reported GPU-seconds on H100, so the answer is known by hand:

    task A (2 steps): step 0 breaks mid-stream after 1 GPU-s and resumes on B (2 GPU-s), ok;
      step 1 ok (3 GPU-s): A succeeds.
    task B (3 steps): step 0 ok (1 GPU-s), step 1 fails (0.5 GPU-s); the client gives up and
      B fails when it goes idle.
    """
    inf = parse_inference_request("chat", body())

    def step(task: str, n: int, of: int, now: float) -> object:
        r = routing(("x-meshd-task-id", task), ("x-meshd-tenant", "acme"))
        return observer.begin("chat", "default", inf, r, f"{task}-{n}", now, step=n,
                              steps_in_task=of)  # fmt: skip

    req = step("A", 0, 2, t0)
    assert hasattr(req, "attempt")
    a = req.attempt(A, "H100", t0)
    a.first_token(t0 + 0.05)
    a.end("stream_broken", 200, 0, 600, 10, t0 + 0.5, gpu_seconds=1.0)
    req.resumed("resumed", t0 + 0.5, tokens_sent=10)
    b = req.attempt(B, "H100", t0 + 0.5, reason="resume")
    b.first_token(t0 + 0.6)
    b.end("ok", 200, 400, 610, 54, t0 + 1.0, gpu_seconds=2.0)
    req.finish("ok", None, t0 + 1.0, status=200)
    req = step("A", 1, 2, t0 + 2)
    a = req.attempt(A, "H100", t0 + 2)
    a.end("ok", 200, 512, 700, 64, t0 + 3, gpu_seconds=3.0)
    req.finish("ok", None, t0 + 3, status=200)

    req = step("B", 0, 3, t0 + 4)
    a = req.attempt(B, "H100", t0 + 4)
    a.end("ok", 200, 0, 100, 20, t0 + 5, gpu_seconds=1.0)
    req.finish("ok", None, t0 + 5, status=200)
    req = step("B", 1, 3, t0 + 6)
    a = req.attempt(B, "H100", t0 + 6)
    a.end("upstream_error", 502, None, 100, None, t0 + 7, gpu_seconds=0.5)
    req.finish("upstream_error", None, t0 + 7, status=502)


def test_access_log_read_by_meshd_cost_gives_cost_per_successful_task(tmp_path: Path) -> None:
    path = tmp_path / "access.jsonl"
    metrics = DataPlaneMetrics()
    observer = RequestObserver(metrics, access_log=AccessLogWriter(path))
    t0 = time.monotonic()
    run_tasks(observer, t0)
    observer.tick(t0 + 7 + 601)  # B idle past the ledger's timeout: failed
    observer.close()

    spend = (1.0 + 2.0 + 3.0 + 1.0 + 0.5) * H100_PER_S  # everything, waste included
    per_ok_task = spend / 1  # one task (A) succeeded
    records = list(read_access_log(path))
    assert [r.request_id for r in records] == ["A-0", "A-1", "B-0", "B-1"]
    first = records[0]
    assert [a.endpoint for a in first.attempts] == [A, B]
    assert [a.reason for a in first.attempts] == ["", "resume"]
    assert first.completion_tokens == 64 and first.prompt_tokens == 600
    assert first.ttft_s == pytest.approx(0.05)
    assert first.gpu_seconds == pytest.approx(3.0) and first.gpu_seconds_source == "reported"
    assert first.cost_usd == pytest.approx(3.0 * H100_PER_S)
    assert (first.tenant, first.task_id, first.step, first.steps_in_task) == ("acme", "A", 0, 2)
    assert records[3].outcome == "upstream_error" and records[3].status == 502

    # The live figures and the ones `meshd cost` reads back agree with the hand answer.
    assert value(metrics, "meshd_cost_per_successful_task_usd") == pytest.approx(per_ok_task)
    assert value(metrics, "meshd_tasks_total", pool="default", outcome="success") == 1
    assert value(metrics, "meshd_tasks_total", pool="default", outcome="failure") == 1
    waste = {
        k: value(metrics, "meshd_waste_usd_total", pool="default", kind=k)
        for k in ("retries", "failed_requests", "failed_tasks", "abandoned_streams")
    }
    assert waste == pytest.approx(
        {
            "retries": 1.0 * H100_PER_S,
            "failed_requests": 0.5 * H100_PER_S,
            "failed_tasks": 1.0 * H100_PER_S,
            "abandoned_streams": 0.0,
        }
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cost_cmd.main(["--log", str(path)]) == 0
    _, _, row = out.getvalue().splitlines()[:3]
    cells = dict(zip(cost_cmd.HEADER, re.split(r"\s{2,}", row), strict=True))
    assert cells["tasks ok/all"] == "1/2"
    assert cells["$/ok task"] == f"${per_ok_task:.6f}"
    assert cells["retries"] == f"${1.0 * H100_PER_S:.6f}"
    assert cells["failed tasks"] == f"${1.0 * H100_PER_S:.6f}"


def test_a_split_requests_prefill_step_is_part_of_its_answer_not_a_retry() -> None:
    """A prefill/decode request: its prefill step (reason "prefill", ok) and its decode
    step are the answer; only a failed try before them is retry waste, in the live
    metric as in the ledger."""
    metrics = DataPlaneMetrics()
    observer = RequestObserver(metrics)
    inf = parse_inference_request("chat", body())
    t0 = time.monotonic()
    req = observer.begin("chat", "default", inf, routing(), "pd-1", t0)
    assert hasattr(req, "attempt")
    lost = req.attempt(A, "H100", t0, reason="prefill")
    lost.end("connect_error", 0, None, None, None, t0 + 0.01, gpu_seconds=0.25)
    pre = req.attempt(B, "H100", t0 + 0.01, reason="prefill")
    pre.first_token(t0 + 0.1)
    pre.end("ok", 200, 0, 600, 1, t0 + 0.1, gpu_seconds=1.0)
    dec = req.attempt(A, "H100", t0 + 0.1, reason="decode")
    dec.first_token(t0 + 0.2)
    dec.end("ok", 200, 0, 600, 64, t0 + 1.0, gpu_seconds=2.0)
    req.finish("ok", None, t0 + 1.0, status=200)
    observer.close()
    retries = value(metrics, "meshd_waste_usd_total", pool="default", kind="retries")
    assert retries == pytest.approx(0.25 * H100_PER_S)


def test_full_queue_drops_and_counts(tmp_path: Path) -> None:
    metrics = DataPlaneMetrics()
    writer = AccessLogWriter(tmp_path / "a.jsonl", queue_size=1, start=False)
    observer = RequestObserver(metrics, access_log=writer)
    for i in range(3):
        req = observer.begin("chat", "default", None, None, f"r{i}", 0.0)
        req.finish("ok", None, 0.1)
    assert value(metrics, "meshd_access_log_dropped_records_total") == 2
    observer.close()
    assert len(list(read_access_log(tmp_path / "a.jsonl"))) == 1


# ---------------------------------------------------------------- metrics


def test_metrics_move() -> None:
    metrics = DataPlaneMetrics()
    observer = RequestObserver(metrics)
    streamed_request_with_retry(observer, 100.0, [("x-meshd-tenant", "acme")])
    lab = {"pool": "default", "endpoint": B, "model": MODEL, "tenant": "acme"}
    assert value(metrics, "meshd_time_to_first_token_seconds_count", **lab) == 1
    assert value(metrics, "meshd_time_to_first_token_seconds_sum", **lab) == pytest.approx(0.07)
    # (0.7 - 0.07) s over 63 gaps between 64 tokens
    itl = value(metrics, "meshd_inter_token_latency_seconds_sum", **lab)
    assert itl == pytest.approx(0.63 / 63)
    e2e = {"kind": "chat", **lab}
    assert value(metrics, "meshd_request_duration_seconds_sum", **e2e) == pytest.approx(0.7)
    assert value(metrics, "meshd_requests_total", kind="chat", pool="default", outcome="ok") == 1
    ep = {"pool": "default", "endpoint": B}
    assert value(metrics, "meshd_prompt_tokens_total", **ep) == 600
    assert value(metrics, "meshd_completion_tokens_total", **ep) == 64
    assert value(metrics, "meshd_prefix_cache_hit_tokens_total", **ep) == 512
    assert value(metrics, "meshd_prefix_cache_predicted_tokens_total", **ep) == 0  # B: none
    busy = value(metrics, "meshd_gpu_busy_seconds_total", pool="default", gpu="H100")
    usd = value(metrics, "meshd_cost_usd_total", pool="default", gpu="H100")
    assert busy > 0 and usd == pytest.approx(busy * H100_PER_S)
    # A lone request is a task of its own, closed by its own success.
    assert value(metrics, "meshd_tasks_total", pool="default", outcome="success") == 1
    assert value(metrics, "meshd_successful_tasks_per_usd") == pytest.approx(1 / usd)


def test_the_task_ratio_gauges_move_when_a_task_closes_not_with_each_request() -> None:
    metrics = DataPlaneMetrics()
    observer = RequestObserver(metrics)
    assert value(metrics, "meshd_cost_per_successful_task_usd") == 0
    assert value(metrics, "meshd_successful_tasks_per_usd") == 0
    # Step 0 of a two-step task: spent, but no task has closed, so the ratios stay.
    routing_headers = routing(("x-meshd-task-id", "t1"), ("x-meshd-task-steps", "2"))
    req = observer.begin(
        "chat", "default", parse_inference_request("chat", body()), routing_headers, "r0", 0.0,
        step=0, steps_in_task=2,
    )  # fmt: skip
    a = req.attempt(A, "H100", 0.0)
    a.end("ok", 200, None, 100, 10, 0.5)
    req.finish("ok", None, 0.5, status=200)
    assert observer.spent_usd > 0
    assert value(metrics, "meshd_cost_per_successful_task_usd") == 0
    assert value(metrics, "meshd_successful_tasks_per_usd") == 0
    # A lone request: a task closed by its own success; the ratios take every dollar so far.
    req = observer.begin("chat", "default", parse_inference_request("chat", body()), None, "r1", 1)
    a = req.attempt(A, "H100", 1.0)
    a.end("ok", 200, None, 100, 10, 1.5)
    req.finish("ok", None, 1.5, status=200)
    spent = observer.spent_usd
    assert observer.tasks_succeeded == 1
    assert value(metrics, "meshd_cost_per_successful_task_usd") == pytest.approx(spent)
    assert value(metrics, "meshd_successful_tasks_per_usd") == pytest.approx(1 / spent)


def test_finish_is_idempotent_and_ends_what_was_left_open() -> None:
    metrics = DataPlaneMetrics()
    observer = RequestObserver(metrics)
    req = observer.begin("chat", "default", parse_inference_request("chat", body()), None, "r", 0)
    a = req.attempt(A, "H100", 0.0)
    b = req.attempt(B, "H100", 0.1)  # A was never ended: it is abandoned
    b.first_token(0.2)
    req.finish("client_disconnect", None, 0.5)
    req.finish("ok", None, 0.9)
    assert (a.outcome, b.outcome) == ("abandoned", "client_disconnect")
    assert value(metrics, "meshd_requests_total", kind="chat", pool="default",
                 outcome="client_disconnect") == 1  # fmt: skip
    assert value(metrics, "meshd_requests_total", kind="chat", pool="default", outcome="ok") == 0
    rec = req.to_record()
    assert rec.outcome == "client_disconnect" and rec.e2e_s == pytest.approx(0.5)
    assert rec.prompt_tokens == req.inference.estimated_prompt_tokens  # type: ignore[union-attr]


def test_a_request_that_reached_no_engine_costs_nothing() -> None:
    metrics = DataPlaneMetrics()
    observer = RequestObserver(metrics)
    req = observer.begin("chat", "default", parse_inference_request("chat", body()), None, "r", 0)
    req.finish("admission_rejected", None, 0.01, status=429)
    rec = req.to_record()
    assert rec.cost_usd == 0 and rec.gpu_seconds == 0 and rec.gpu_seconds_source == "none"
    assert rec.endpoint is None
    assert value(metrics, "meshd_tasks_total", pool="default", outcome="failure") == 1


def test_tenant_and_model_labels_are_bounded() -> None:
    labels = BoundedLabels(2, preset=["gold"])
    assert [labels(v) for v in ("a", "b", "c", "gold", None, "a")] == [
        "a", "b", "other", "gold", "none", "a",
    ]  # fmt: skip
    metrics = DataPlaneMetrics()
    observer = RequestObserver(metrics, max_tenant_labels=1, tenants=["gold"])
    inf = parse_inference_request("chat", body())
    for tenant in ("t1", "t2", "t3", "gold"):
        req = observer.begin("chat", "p", inf, routing(("x-meshd-tenant", tenant)), "r", 0.0)
        req.attempt(A, None, 0.0).first_token(0.1)
        req.finish("ok", None, 0.2)
    tenants = {
        dict(k[1])["tenant"]: v
        for k, v in samples(metrics).items()
        if k[0] == "meshd_time_to_first_token_seconds_count"
    }
    assert tenants == {"t1": 1, "other": 2, "gold": 1}


def test_from_config_sets_provisioned_gpus_and_prices(tmp_path: Path) -> None:
    config = load_config(
        None,
        overrides=[
            'pools=[{"name": "p", "models": ["m"], "endpoints": ['
            '{"url": "http://a:1", "gpu": "H100"}, {"url": "http://b:1", "gpu": "H100"},'
            '{"url": "http://c:1", "gpu": "A100"}]}]',
            f"telemetry.access_log.path={tmp_path / 'log.jsonl'}",
            "telemetry.prices_usd_per_gpu_hour={H100: 36.0}",
        ],
    )
    clock = [1000.0]
    metrics = DataPlaneMetrics(clock=lambda: clock[0])
    observer = RequestObserver.from_config(config, metrics)
    assert observer.access_log is not None and observer.tracer_provider is None
    prov = metrics.gpu_provisioned_seconds
    prov.set_gpus("p", "H100", 2, 1000.0)  # the start, on the fake clock
    prov.set_gpus("p", "A100", 1, 1000.0)
    clock[0] = 1010.0
    assert value(metrics, "meshd_gpu_provisioned_seconds_total", pool="p", gpu="H100") == 20
    assert value(metrics, "meshd_gpu_provisioned_seconds_total", pool="p", gpu="A100") == 10
    req = observer.begin("chat", "p", parse_inference_request("chat", body()), None, "r", 0)
    a = req.attempt("http://a:1", None, 0.0)  # GPU from the config
    a.end("ok", 200, 0, 10, 10, 1.0, gpu_seconds=100.0)
    req.finish("ok", None, 1.0)
    assert req.gpu == "H100"
    assert req.cost_usd == pytest.approx(100.0 * 36.0 / 3600)
    observer.close()
    (rec,) = read_access_log(tmp_path / "log.jsonl")
    assert rec.cost_usd == pytest.approx(1.0)


def test_a_counter_adder_adds_as_the_counter_would() -> None:
    metrics = DataPlaneMetrics()
    child = metrics.requests.labels("chat", "default", "ok")
    add = counter_adder(child)
    assert add != child.inc  # its LoopValue's own inc (meshd/metrics.py)
    add(1)
    add(2.5)
    child.inc()
    assert value(metrics, "meshd_requests_total", kind="chat", pool="default", outcome="ok") == 4.5

    # A value kept some other way (multiprocess mode): the counter's own inc.
    other = types.SimpleNamespace(_value=object(), inc=lambda amount=1: None)
    assert counter_adder(other) is other.inc
