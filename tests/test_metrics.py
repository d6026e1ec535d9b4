"""meshd/metrics.py: every metric the Grafana dashboard (helm/meshd/dashboards/meshd.json)
and the README's metrics table name is one DataPlaneMetrics registers; the reliability
metrics the sidecar writes have the names and labels it is promised."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meshd.heap import GcCollector, gc_pauses
from meshd.metrics import (
    BREAKER_HALF_OPEN,
    BREAKER_OPEN,
    DataPlaneMetrics,
    LoopValue,
    _LoopCounter,
    _LoopGauge,
    _LoopHistogram,
    counter_adder,
)
from meshd.response_cache import ResponseCacheMetrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "helm" / "meshd" / "dashboards" / "meshd.json"
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def registered_series() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every series name DataPlaneMetrics can expose -> (family type, label names)."""
    m = DataPlaneMetrics()
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for collector in list(m.registry._collector_to_names):
        labels = tuple(getattr(collector, "_labelnames", None) or getattr(collector, "LABELS", ()))
        for family in collector.describe() if hasattr(collector, "describe") else ():
            for suffix in SUFFIXES.get(family.type, ("",)):
                out[family.name + suffix] = (family.type, labels)
    return out


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in doc["templating"]["list"] if v.get("type") == "query"]
    return exprs


def test_every_dashboard_metric_is_registered() -> None:
    series = registered_series()
    used = {n for e in dashboard_exprs() for n in re.findall(r"\b(meshd_[a-z_]+)", e)}
    assert len(used) >= 20
    missing = sorted(used - set(series))
    assert missing == [], f"dashboard uses metrics DataPlaneMetrics does not register: {missing}"


def test_dashboard_label_selectors_exist_on_their_metrics() -> None:
    series = registered_series()
    for expr in dashboard_exprs():
        for name, selector in re.findall(r"\b(meshd_[a-z_]+)\{([^}]*)\}", expr):
            keys = set(re.findall(r"([a-z_]+)\s*=~?", selector))
            labels = set(series[name][1]) | ({"le"} if name.endswith("_bucket") else set())
            assert keys <= labels, f"{name}: {sorted(keys - labels)} not among {sorted(labels)}"
        for by in re.findall(r"by \(([^)]*)\)", expr):
            names = re.findall(r"\b(meshd_[a-z_]+)", expr)
            keys = {k.strip() for k in by.split(",")} - {"le"}
            assert any(keys <= set(series[n][1]) for n in names), (expr, keys)


def exposed_names() -> set[str]:
    """What the README names: counters with _total, histograms and gauges as they are
    (the sidecar's and, registered beside them when it is on, the response cache's)."""
    m = DataPlaneMetrics()
    ResponseCacheMetrics(m.registry)
    m.registry.register(GcCollector(gc_pauses()))  # the sidecar registers it beside them
    out = set()
    for collector in list(m.registry._collector_to_names):
        for family in collector.describe():
            out.add(family.name + ("_total" if family.type == "counter" else ""))
    return out


def test_readme_documents_every_metric() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Metrics", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(meshd_[a-z_]+)`", section, re.MULTILINE))
    exposed = exposed_names()
    assert sorted(exposed - documented) == [], "metrics missing from README.md"
    assert sorted(documented - exposed) == [], "README.md documents metrics that do not exist"


@pytest.mark.parametrize(
    ("attr", "name", "labels"),
    [
        ("breaker_state", "meshd_breaker_state", ("pool", "endpoint")),
        ("breaker_transitions", "meshd_breaker_transitions_total", ("pool", "endpoint", "to")),
        ("breaker_rejections", "meshd_breaker_rejections_total", ("pool", "reason")),
        ("outlier_ejected", "meshd_outlier_ejected", ("pool", "endpoint")),
        ("outlier_ejections", "meshd_outlier_ejections_total", ("pool", "endpoint", "reason")),
        ("admission_queue_depth", "meshd_admission_queue_depth", ("pool",)),
        ("admission_queue_wait", "meshd_admission_queue_wait_seconds_count", ("pool",)),
        ("admission_rejections", "meshd_admission_rejections_total", ("pool", "reason")),
        ("throttled_requests", "meshd_throttled_requests_total", ("pool",)),
        ("stream_resumes", "meshd_stream_resumes_total", ("pool", "outcome")),
        ("tokens_in_flight", "meshd_tokens_in_flight", ("pool",)),
    ],
)
def test_reliability_metrics_have_their_names_and_labels(
    attr: str, name: str, labels: tuple[str, ...]
) -> None:
    m = DataPlaneMetrics()
    child = getattr(m, attr).labels(*(f"v-{x}" for x in labels))
    if hasattr(child, "observe"):
        child.observe(0.2)
    elif name.endswith("_total"):
        child.inc()
    else:
        child.set(BREAKER_OPEN if attr == "breaker_state" else 1)
    text = generate_latest(m.registry).decode()
    (sample,) = [
        s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    ]
    assert sample.labels == {x: f"v-{x}" for x in labels}
    assert sample.value in (1.0, float(BREAKER_OPEN))
    assert BREAKER_HALF_OPEN == 1


def test_legacy_positional_label_calls_still_work() -> None:
    m = DataPlaneMetrics()
    m.ttft.labels("default", "http://a:1").observe(0.1)
    m.request_duration.labels("chat", "default").observe(0.2)
    text = generate_latest(m.registry).decode()
    assert (
        'meshd_time_to_first_token_seconds_count{endpoint="http://a:1",model="",pool="default",'
        'tenant=""} 1.0' in text
    )
    with pytest.raises(ValueError):
        m.ttft.labels("a", "b", "c", "d", "e")


_amounts = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.005, 0.01, 1.0, 300.0, -1.0]),  # on and around the bounds
)


def _exposition(registry: CollectorRegistry) -> list[str]:
    """/metrics without the _created lines (a clock reading when each child was made)."""
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


@settings(max_examples=200, deadline=None)
@given(
    observations=st.lists(st.tuples(st.sampled_from(["a", "b"]), _amounts), max_size=30),
    adds=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.floats(0, 1e6)), max_size=10),
)
def test_loop_metrics_expose_what_the_library_s_own_would(
    observations: list[tuple[str, float]], adds: list[tuple[str, float]]
) -> None:
    """meshd/metrics.py's lock-free metrics (LoopValue, the histogram's bisected bucket,
    counter_adder) against prometheus_client's classes fed the same: the same /metrics."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    kw: dict[str, Any] = {"buckets": (0.005, 0.01, 0.5, 1.0, 300.0)}
    h1 = _LoopHistogram("h_seconds", "h", ["k"], registry=ours, **kw)
    h2 = Histogram("h_seconds", "h", ["k"], registry=theirs, **kw)
    c1 = _LoopCounter("c", "c", ["k"], registry=ours)
    c2 = Counter("c", "c", ["k"], registry=theirs)
    g1 = _LoopGauge("g", "g", ["k"], registry=ours)
    g2 = Gauge("g", "g", ["k"], registry=theirs)
    for label, amount in observations:
        h1.labels(label).observe(amount)
        h2.labels(label).observe(amount)
        g1.labels(label).inc(amount)
        g2.labels(label).inc(amount)
    for label, amount in adds:
        counter_adder(c1.labels(label))(amount)
        c2.labels(label).inc(amount)
    assert _exposition(ours) == _exposition(theirs)
    with pytest.raises(ValueError, match="missing label values"):
        h1.observe(1.0)  # a labelled parent: refused, as the library does


def test_data_plane_metrics_keep_loop_values() -> None:
    m = DataPlaneMetrics()
    assert type(m.requests.labels("chat", "p", "ok")._value) is LoopValue
    assert type(m.tokens_in_flight.labels("p")._value) is LoopValue
    child = m.ttft.labels("p", "e", "m", "t")
    assert type(child._sum) is LoopValue
    assert {type(b) for b in child._buckets} == {LoopValue}
