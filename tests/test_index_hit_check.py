"""The prefix index checked against the engine's own prefix-cache counters (issue #27: "Check
the model against the engine's own prefix-cache counters (vllm:prefix_cache_hits / queries)
and correct it; its error is a metric"): the counters read off a page, their change between
two pages, the picker's verdict and its capacity step, and a live sidecar given only the
engine's URL putting the error on its /metrics."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from harness import sidecar_config, url
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.blockhash import block_hashes
from filters.endpoint_state import EndpointState
from filters.engine_probe import ProbeState
from filters.picker import (
    HIT_CHECK_MIN_REQUESTS,
    INDEX_CAPACITY_GROW,
    INDEX_CAPACITY_SHRINK,
    Picker,
    PickRequest,
)
from filters.vllm_metrics import parse_engine_metrics
from loadtest.engine import EngineSpec, SimEngine
from meshd.sidecar import Sidecar

SYSTEM = "You are a meticulous assistant that answers in full sentences. " * 60


def page(queries: float | None, hits: float | None, prompts: float = 5.0) -> str:
    lines = [
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0',
        "# TYPE vllm:prompt_tokens_total counter",
        f'vllm:prompt_tokens_total{{model_name="m"}} {prompts}',
    ]
    if queries is not None:
        lines += [
            "# TYPE vllm:prefix_cache_queries counter",
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}',
        ]
    if hits is not None:
        lines += [
            "# TYPE vllm:prefix_cache_hits counter",
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}',
        ]
    return "\n".join([*lines, ""])


def test_the_counters_are_read_and_summed_over_engines():
    text = page(100.0, 40.0) + 'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 2\n'
    m = parse_engine_metrics(text)
    assert (m.prefix_queries, m.prefix_hits) == (100.0, 42.0)
    bare = parse_engine_metrics(page(None, None))
    assert bare.prefix_queries is None and bare.prefix_hits is None


def test_the_window_is_the_change_between_two_good_pages():
    p = ProbeState("http://e")
    assert p.observed(page(100.0, 40.0), 0.0).prefix_window is None  # no earlier page
    assert p.observed(page(300.0, 90.0), 2.0).prefix_window == (200.0, 50.0)
    # A failed scrape in between: the next window runs from the last good page.
    assert p.observed(None, 4.0, error="HTTP 503").prefix_window is None
    assert p.observed(page(400.0, 190.0), 6.0).prefix_window == (100.0, 100.0)
    # A restart (the counters went back): no window across it.
    r = p.observed(page(10.0, 5.0, prompts=1.0), 8.0)
    assert r.restarted and r.prefix_window is None
    assert p.observed(page(20.0, 5.0, prompts=2.0), 10.0).prefix_window == (10.0, 0.0)
    # A page that does not count them gives none.
    assert p.observed(page(None, None, prompts=3.0), 12.0).prefix_window is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e9), st.floats(0, 1e9)), min_size=1, max_size=8))
def test_a_window_is_never_negative(pages):
    p = ProbeState("http://e")
    for i, (q, h) in enumerate(pages):
        w = p.observed(page(q, h, prompts=float(i)), float(i)).prefix_window
        assert w is None or (w[0] >= 0 and w[1] >= 0)


def _picker_with_history(
    n: int, held: str = SYSTEM
) -> tuple[Picker, list[EndpointState], list[PickRequest]]:
    """e0 known to hold `held`'s blocks; n requests each `held` then a tail of its own."""
    eps = [EndpointState("e0", url="http://e0", gpu="H100")]
    p = Picker()
    base = block_hashes(held, "m")
    p.index.record("e0", base, 0.0)
    reqs = []
    for i in range(n):
        text = held + f"question {i}, " * (len(SYSTEM) // 40)
        reqs.append(PickRequest("m", block_hashes(text, "m"), prompt_tokens=len(text) // 4))
    return p, eps, reqs


def _send(p: Picker, eps: list[EndpointState], reqs: list[PickRequest], now: float) -> float:
    """Dispatch each request to its pick; the predicted hit rate of the lot."""
    pred = total = 0.0
    for i, r in enumerate(reqs):
        c = p.pick(r, eps, now)[0]
        assert c.endpoint == "e0" and c.cached_tokens > 0
        p.dispatch(c, r, ("rid", now, i), now)
        pred += c.cached_tokens
        total += r.prompt_tokens
    return pred / total


def test_an_engine_that_finds_fewer_hits_shrinks_the_index():
    p, eps, reqs = _picker_with_history(HIT_CHECK_MIN_REQUESTS)
    assert p.observe_engine_hits("e0", 1e6, 9e5, 0.0) is None  # the first window arms it
    predicted = _send(p, eps, reqs, 1.0)
    scale = p.index_capacity_scale("e0")
    assert predicted > 0.5
    # The engine found 10% where the index predicted more than half: ghosts.
    err = p.observe_engine_hits("e0", 1000.0, 100.0, 2.0)
    assert err == pytest.approx(predicted - 0.1)
    assert p.hit_error["e0"] == err
    assert p.index_capacity_scale("e0") == pytest.approx(scale * INDEX_CAPACITY_SHRINK)


def test_no_verdict_before_enough_requests_and_none_inside_the_dead_band():
    p, eps, reqs = _picker_with_history(HIT_CHECK_MIN_REQUESTS)
    p.observe_engine_hits("e0", 0.0, 0.0, 0.0)
    predicted = _send(p, eps, reqs[:-1], 1.0)
    scale = p.index_capacity_scale("e0")
    assert p.observe_engine_hits("e0", 1000.0, 0.0, 2.0) is None  # one request short
    _send(p, eps, reqs[-1:], 3.0)
    # The engine's hits over both windows agree with the prediction: an error, no step.
    q = 2000.0
    err = p.observe_engine_hits("e0", q - 1000.0, predicted * q, 4.0)
    assert err is not None and abs(err) < 0.05
    assert p.index_capacity_scale("e0") == scale


def test_an_engine_that_finds_more_hits_grows_the_index():
    # The index knows a quarter of the prompt there; the engine found twice that.
    p, eps, reqs = _picker_with_history(HIT_CHECK_MIN_REQUESTS, held=SYSTEM[: len(SYSTEM) // 4])
    p.observe_engine_hits("e0", 0.0, 0.0, 0.0)
    predicted = _send(p, eps, reqs, 1.0)
    assert 0.1 < predicted < 0.5
    scale = p.index_capacity_scale("e0")
    p.observe_engine_hits("e0", 1000.0, 1000.0 * 2.0 * predicted, 2.0)
    assert p.index_capacity_scale("e0") == pytest.approx(scale * INDEX_CAPACITY_GROW)


def test_per_answer_cached_tokens_take_precedence():
    # An engine whose answers detail their cached tokens is learnt from those
    # (observe_cached); its counters still give the error.
    p, eps, reqs = _picker_with_history(HIT_CHECK_MIN_REQUESTS)
    p.observe_engine_hits("e0", 0.0, 0.0, 0.0)
    c = p.pick(reqs[0], eps, 0.5)[0]
    p.observe_cached(c, reqs[0], c.cached_tokens, 0.5)  # as predicted: no step
    scale = p.index_capacity_scale("e0")
    _send(p, eps, reqs, 1.0)
    err = p.observe_engine_hits("e0", 1000.0, 0.0, 2.0)
    assert err is not None and err > 0.5
    assert p.index_capacity_scale("e0") == scale


def test_a_forgotten_endpoint_starts_over():
    p, eps, reqs = _picker_with_history(HIT_CHECK_MIN_REQUESTS)
    p.observe_engine_hits("e0", 0.0, 0.0, 0.0)
    _send(p, eps, reqs, 1.0)
    p.forget("e0")
    assert p.observe_engine_hits("e0", 1000.0, 0.0, 2.0) is None  # armed again, no verdict
    assert "e0" not in p.hit_error


# -- live: a sidecar given only the URL -------------------------------------------------------


async def test_a_sidecar_checks_its_index_against_the_engines_counters():
    engine = SimEngine(EngineSpec(name="e0", kv_blocks=512, block_size=16, time_scale=50.0))
    await engine.start()
    cfg = sidecar_config(
        [engine.url], routing={"engine_metrics": {"interval_s": 0.05, "max_backoff_s": 0.2}}
    )
    s = Sidecar(cfg)
    await s.start()
    registry = s.metrics.registry
    labels = {"pool": "default", "endpoint": engine.url}
    try:
        await engine.wait_ready()
        deadline = time.monotonic() + 20.0
        async with aiohttp.ClientSession() as session:
            i = 0
            while registry.get_sample_value("meshd_prefix_index_hit_error", labels) is None:
                assert time.monotonic() < deadline, "no check of the index reached /metrics"
                body = {"model": engine.spec.model, "prompt": SYSTEM + f"q{i}", "max_tokens": 2}
                async with session.post(url(s, "/v1/completions"), json=body) as r:
                    assert r.status == 200, await r.text()
                i += 1
                await asyncio.sleep(0.01)
        error = registry.get_sample_value("meshd_prefix_index_hit_error", labels)
        assert error is not None and -1.0 <= error <= 1.0
        assert s.routers["default"].picker.hit_error[engine.url] == error  # type: ignore[attr-defined]
        # /endpoints shows it, with the index's learnt capacity factor.
        (row,) = s.routers["default"].snapshot(time.monotonic())
        assert row["index_hit_error"] == round(error, 3)
        assert isinstance(row["index_capacity_scale"], float) and row["index_capacity_scale"] > 0
    finally:
        await s.drain_and_stop()
        await engine.stop()
