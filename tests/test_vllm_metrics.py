"""filters/vllm_metrics.py: vLLM's /metrics (the simulator's, which uses vLLM's names) and
SGLang's (a sample after sgl-project/sglang docs/references/production_metrics.md)."""

from __future__ import annotations

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from filters.vllm_metrics import (
    EngineMetrics,
    Histogram,
    MetricsParseError,
    MetricsTracker,
    parse_engine_metrics,
    parse_samples,
)
from loadtest.engine import EngineSpec, SimEngine

_SGLANG_RAW = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="M"} 8.128902e+06
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="M"} 7.557572e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="M"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="M"} 0.007507552643049313
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="M"} 2.3518979474117756e+06
sglang:time_to_first_token_seconds_bucket{le="0.001",model_name="M"} 0.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="M"} 11008.0
sglang:time_to_first_token_seconds_count{model_name="M"} 11008.0
# HELP sglang:time_per_output_token_seconds Histogram of time per output token in seconds.
# TYPE sglang:time_per_output_token_seconds histogram
sglang:time_per_output_token_seconds_sum{model_name="M"} 866964.5791549598
sglang:time_per_output_token_seconds_bucket{le="+Inf",model_name="M"} 7.400757e+06
sglang:time_per_output_token_seconds_count{model_name="M"} 7.400757e+06
# HELP sglang:func_latency_seconds Function latency in seconds
# TYPE sglang:func_latency_seconds histogram
sglang:func_latency_seconds_sum{name="generate_request"} 4.514771912145079
sglang:func_latency_seconds_count{name="generate_request"} 14007.0
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="M"} 162.0
# HELP sglang:num_used_tokens The number of used tokens
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="M"} 123859.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="M"} 2826.0
"""
SGLANG_TEXT = _SGLANG_RAW.replace('"M"', '"meta-llama/Llama-3.1-8B-Instruct"')


@pytest.fixture
async def sim_text() -> str:
    engine = SimEngine(EngineSpec(kv_blocks=64, block_size=16, time_scale=50.0))
    await engine.start()
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": engine.spec.model, "prompt": "hello world " * 40, "max_tokens": 4}
            async with s.post(engine.url + "/v1/completions", json=body) as r:
                assert r.status == 200
            async with s.get(engine.url + "/metrics") as r:
                return await r.text()
    finally:
        await engine.stop()


async def test_vllm_metrics_from_the_simulator(sim_text: str) -> None:
    m = parse_engine_metrics(sim_text)
    assert m.flavor == "vllm"
    assert m.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert (m.running, m.waiting) == (0, 0)
    assert m.kv_usage == 0.0
    assert (m.kv_block_size, m.kv_capacity_blocks) == (16, 64)
    assert m.gpu == "H100"
    assert m.ttft is not None and m.ttft.count == 1 and m.ttft.sum > 0
    # 4 output tokens: 3 inter-token gaps.
    assert m.tpot is not None and m.tpot.count == 3
    assert m.counters["vllm:generation_tokens_total"] == 4
    assert m.cache_hit_rate == 0.0


def test_sglang_metrics() -> None:
    m = parse_engine_metrics(SGLANG_TEXT)
    assert m.flavor == "sglang"
    assert (m.running, m.waiting) == (162, 2826)
    assert m.kv_usage == pytest.approx(0.28)
    assert m.cache_hit_rate == pytest.approx(0.0075075526)
    assert m.ttft == Histogram(11008.0, 2.3518979474117756e06)
    assert m.tpot is not None and m.tpot.count == 7.400757e06
    assert m.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert m.kv_capacity_blocks is None


def test_labels_with_escapes_and_timestamps() -> None:
    text = 'a{x="q\\"uo\\\\te",y="n\\nl"} 1.5 1700000000\nb 2\nc{} NaN\nd +Inf\n'
    samples = list(parse_samples(text))
    assert samples[0].labels == (("x", 'q"uo\\te'), ("y", "n\nl"))
    assert samples[0].value == 1.5
    assert [s.name for s in samples] == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    "line", ["a{x=1} 2", 'a{x="1" 2', "a", 'a{x="1"} notanumber', "9bad 1", "a 1 2 3"]
)
def test_malformed_lines_raise_the_one_error(line: str) -> None:
    with pytest.raises(MetricsParseError):
        list(parse_samples(line))


def test_unknown_text_is_refused() -> None:
    with pytest.raises(MetricsParseError):
        parse_engine_metrics("up 1\n")


@given(st.text(max_size=300))
def test_any_text_parses_or_raises_metrics_parse_error(text: str) -> None:
    try:
        list(parse_samples(text))
        parse_engine_metrics("vllm:x 1\n" + text)
    except MetricsParseError:
        pass


def _m(ttft: tuple[float, float], gen: float) -> EngineMetrics:
    return EngineMetrics(
        flavor="vllm",
        ttft=Histogram(*ttft),
        counters={"vllm:generation_tokens_total": gen},
    )


def test_tracker_averages_deltas_and_sees_resets() -> None:
    t = MetricsTracker(alpha=0.5)
    u = t.update(_m((2, 0.2), 10))
    assert u.ttft_s == pytest.approx(0.1) and not u.counters_reset
    # One new request with TTFT 0.3: halfway from 0.1.
    u = t.update(_m((3, 0.5), 20))
    assert u.ttft_s == pytest.approx(0.2)
    # Nothing new: the average stays.
    assert t.update(_m((3, 0.5), 20)).ttft_s == pytest.approx(0.2)
    # Counters fell: a new process; the average starts over from its figures.
    u = t.update(_m((1, 0.05), 3))
    assert u.counters_reset and u.ttft_s == pytest.approx(0.05)
