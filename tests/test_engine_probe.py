"""The sidecar's own /metrics probe: what a page says (filters/engine_probe.py, fake clock)
and the loop against the engine simulator's real page (meshd/engine_probe.py): a sidecar
given only the URL learns the engine's KV capacity and sees it restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import pytest
from backends import TestBackend as Backend
from harness import sidecar_config, url
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.engine_probe import ProbeState
from loadtest.engine import EngineSpec, SimEngine
from loadtest.engine.faults import FaultSpec
from meshd.config import ConfigError
from meshd.sidecar import Sidecar

WAIT_S = 10.0


def page(
    blocks: int = 1000, block_size: int = 16, prompts: float = 5.0, usage: float = 0.25
) -> str:
    """A vLLM v1 /metrics page, trimmed to what the probe reads."""
    return "\n".join(
        [
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{blocks}",'
            'num_gpu_blocks_override="None"} 1.0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage}',
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{model_name="m"} 3.0',
            "# TYPE vllm:prompt_tokens_total counter",
            f'vllm:prompt_tokens_total{{model_name="m"}} {prompts}',
            "",
        ]
    )


def test_a_page_reports_capacity_and_usage():
    p = ProbeState("http://e", interval_s=2.0)
    r = p.observed(page(blocks=1000, block_size=16, usage=0.25), 1.0)
    assert r.state is not None and r.error is None and not r.restarted
    assert r.state.kv_capacity_tokens == 16_000
    assert r.state.kv_usage == 0.25
    # The load counts stay the sidecar's own (they lag on the page).
    assert r.state.requests_running == 0
    assert r.next_in_s == 2.0 and p.ttl_s() == 6.0


def test_counters_that_go_back_are_a_restart():
    p = ProbeState("http://e")
    assert p.observed(page(prompts=500.0), 1.0).state.epoch == 0  # type: ignore[union-attr]
    more = p.observed(page(prompts=900.0), 3.0)
    assert not more.restarted and more.state.epoch == 0  # type: ignore[union-attr]
    back = p.observed(page(prompts=10.0), 5.0)
    assert back.restarted and back.state.epoch == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (None, "HTTP 404"),
        ('{"path": "/metrics"}', "not an engine's /metrics"),
        ("up 1\n", "not an engine's /metrics"),  # Prometheus text, but no engine's names
    ],
)
def test_what_is_not_a_page(text, why):
    p = ProbeState("http://e", interval_s=1.0, max_backoff_s=8.0)
    delays = [p.observed(text, float(t), error="HTTP 404").next_in_s for t in range(6)]
    r = p.observed(text, 7.0, error="HTTP 404")
    assert r.state is None and why in (r.error or "")
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    # One good page ends the backoff.
    assert p.observed(page(), 8.0).next_in_s == 1.0 and p.failures == 0


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_any_text_is_a_report_or_a_reason(text):
    r = ProbeState("http://e").observed(text, 0.0)
    assert (r.state is None) == (r.error is not None)
    assert r.next_in_s > 0


def test_the_probe_settings_are_checked():
    with pytest.raises(ValueError):
        ProbeState("e", interval_s=10.0, max_backoff_s=1.0)
    with pytest.raises(ConfigError, match="max_backoff_s"):
        sidecar_config(
            ["http://127.0.0.1:1"],
            routing={"engine_metrics": {"interval_s": 5, "max_backoff_s": 1}},
        )


# -- live: the engine simulator's page ---------------------------------------------------------


async def poll(pred: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def endpoint(s: Sidecar, u: str) -> dict[str, object]:
    rows = s.routers["default"].snapshot(time.monotonic())
    return next(r for r in rows if r["url"] == u)


async def test_a_sidecar_given_only_urls_learns_capacity_and_restarts():
    engine = SimEngine(EngineSpec(name="e0", kv_blocks=48, block_size=16, time_scale=50.0))
    await engine.start()
    bare = Backend("bare")  # no /metrics: asked again later, never reported, still served
    await bare.start()
    cfg = sidecar_config(
        [engine.url, bare.url],
        routing={"engine_metrics": {"interval_s": 0.05, "max_backoff_s": 0.2}},
    )
    s = Sidecar(cfg)
    await s.start()
    try:
        await engine.wait_ready()
        await poll(lambda: endpoint(s, engine.url)["kv_capacity_tokens"] == 48 * 16)
        assert endpoint(s, engine.url)["ramp"] == 1.0
        states = s.probes.states
        await poll(lambda: states[("default", bare.url)].failures >= 3)
        assert endpoint(s, bare.url)["reported"] is None
        # Requests go through while a probe fails; the engine counts some work.
        async with aiohttp.ClientSession() as session:
            for target in (url(s, "/v1/completions"), engine.url + "/v1/completions"):
                for i in range(3):
                    body = {"model": engine.spec.model, "prompt": f"p{i} " * 40, "max_tokens": 3}
                    async with session.post(target, json=body) as r:
                        assert r.status == 200, await r.text()
        await poll(lambda: states[("default", engine.url)].tracker.ttft_s is not None)
        # A restart: a new epoch, and the guard ramps the engine back in (slow start).
        engine.inject(FaultSpec("restart"))
        await poll(lambda: states[("default", engine.url)].epoch == 1)
        await poll(lambda: float(endpoint(s, engine.url)["ramp"]) < 1.0)  # type: ignore[arg-type]
    finally:
        await s.drain_and_stop()
        await bare.stop()
        await engine.stop()


async def test_a_control_plane_leaves_the_probe_off():
    cfg = sidecar_config(["http://127.0.0.1:9"], control_plane={"addresses": ["127.0.0.1:9"]})
    s = Sidecar(cfg)
    await s.start()
    try:
        assert s.probes is None
    finally:
        await s.drain_and_stop()


async def test_streams_through_the_sidecar_teach_the_decode_step():
    # The engine simulator runs 50x faster than a real H100: its streams' inter-token
    # latency is far under the step predicted for an unknown GPU, and the sidecar's decode
    # calibration (EndpointState.decode_ratio) moves down from 1.0 as streams finish.
    engine = SimEngine(EngineSpec(name="e0", kv_blocks=256, block_size=16, time_scale=50.0))
    await engine.start()
    s = Sidecar(sidecar_config([engine.url], routing={"engine_metrics": {"enabled": False}}))
    await s.start()
    try:
        await engine.wait_ready()
        assert s.probes is None
        async with aiohttp.ClientSession() as session:
            for i in range(3):
                body = {
                    "model": engine.spec.model,
                    "prompt": f"stream {i} " * 30,
                    "max_tokens": 16,
                    "stream": True,
                }
                async with session.post(url(s, "/v1/completions"), json=body) as r:
                    assert r.status == 200
                    await r.read()
        await poll(lambda: float(endpoint(s, engine.url)["decode_calibration"]) < 1.0)  # type: ignore[arg-type]
    finally:
        await s.drain_and_stop()
        await engine.stop()
