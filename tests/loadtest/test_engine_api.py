"""The simulator's vLLM HTTP API, exercised with the real `openai` client and aiohttp."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.engine import DEFAULT_MODEL, EngineSpec


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_completion_non_streaming(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    r = await client(f.urls[0]).completions.create(
        model=DEFAULT_MODEL, prompt="The quick brown fox", max_tokens=12
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0 and choice.logprobs is None
    assert len(choice.text.split()) >= 10
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 12, 16)
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0


async def test_completion_streams_one_chunk_per_token(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    c = client(f.urls[0])
    stream = await c.completions.create(
        model=DEFAULT_MODEL,
        prompt="Once upon a time",
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [ch async for ch in stream]
    token_chunks = [ch for ch in chunks if ch.choices]
    assert len(token_chunks) == 9
    assert [ch.choices[0].finish_reason for ch in token_chunks] == [None] * 8 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    unary = await c.completions.create(model=DEFAULT_MODEL, prompt="Once upon a time", max_tokens=9)
    assert "".join(ch.choices[0].text for ch in token_chunks) == unary.choices[0].text
    assert len({ch.id for ch in chunks}) == 1


async def test_chat_streaming_and_not(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    c = client(f.urls[0])
    messages: Any = [{"role": "user", "content": "Say something."}]
    r = await c.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=10)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    stream = await c.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=messages,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [ch async for ch in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert chunks[-2].choices[0].finish_reason == "length"


async def test_chat_continuation_on_another_engine_reproduces_the_stream(fleet: Any) -> None:
    f = await fleet(EngineSpec(gpu="H100"), EngineSpec(gpu="A100"))
    messages: Any = [{"role": "user", "content": "Write a poem."}]
    first = await client(f.urls[0]).chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=30, stream=True
    )
    pieces = [ch.choices[0].delta.content or "" async for ch in first if ch.choices][1:]
    assert len(pieces) == 30
    resumed = await client(f.urls[1]).chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[*messages, {"role": "assistant", "content": "".join(pieces[:11])}],
        max_tokens=19,
        stream=True,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    rest = [ch.choices[0].delta.content or "" async for ch in resumed if ch.choices][1:]
    assert rest == pieces[11:]


async def test_repeated_prompt_reports_cached_tokens(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    c = client(f.urls[0])
    prompt = " ".join(f"word{i}" for i in range(100))
    await c.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=2)
    r = await c.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=2)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 96


async def test_token_id_prompts_seed_stop_and_request_id(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    c = client(f.urls[0])
    a = await c.completions.create(
        model=DEFAULT_MODEL, prompt=[1000, 2000, 3000], max_tokens=8, seed=7
    )
    b = await c.completions.create(
        model=DEFAULT_MODEL, prompt=[1000, 2000, 3000], max_tokens=8, seed=8
    )
    assert a.choices[0].text != b.choices[0].text
    word = a.choices[0].text.split()[3]
    s = await c.completions.create(
        model=DEFAULT_MODEL, prompt=[1000, 2000, 3000], max_tokens=8, seed=7, stop=[" " + word]
    )
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].text == a.choices[0].text.split(" " + word)[0]
    r = await c.completions.with_raw_response.create(
        model=DEFAULT_MODEL, prompt="x", max_tokens=1, extra_headers={"X-Request-Id": "abc123"}
    )
    assert r.parse().id == "cmpl-abc123"


@pytest.mark.parametrize(
    ("body", "status", "etype", "param"),
    [
        ({"prompt": "x", "n": 2}, 400, "BadRequestError", "n"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "NotFoundError", "model"),
        (
            {"prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "BadRequestError",
            "stream_options",
        ),
        ({"prompt": "x", "max_tokens": 10_000}, 400, "BadRequestError", "max_tokens"),
        ({"prompt": ""}, 400, "BadRequestError", "prompt"),
        ({"prompt": "x", "logprobs": 2}, 400, "BadRequestError", "logprobs"),
        ({"max_tokens": 3}, 400, "BadRequestError", "prompt"),
    ],
)
async def test_errors_have_vllms_shape(
    fleet: Any, body: dict[str, Any], status: int, etype: str, param: str
) -> None:
    f = await fleet(EngineSpec())
    async with aiohttp.ClientSession() as s, s.post(f.urls[0] + "/v1/completions", json=body) as r:
        assert r.status == status
        doc = await r.json()
    assert set(doc) == {"error"}
    err = doc["error"]
    assert (err["type"], err["code"], err["param"]) == (etype, status, param)
    assert isinstance(err["message"], str) and err["message"]


async def test_chat_rejects_both_generation_prompt_and_continuation(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    with pytest.raises(openai.BadRequestError) as info:
        await client(f.urls[0]).chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )
    assert "continue_final_message" in str(info.value)


async def test_invalid_json_is_a_400(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    async with (
        aiohttp.ClientSession() as s,
        s.post(f.urls[0] + "/v1/chat/completions", data=b"{nope") as r,
    ):
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("fmt", ["TEXT", "JSON"])
async def test_orca_load_header_on_request(fleet: Any, fmt: str) -> None:
    f = await fleet(EngineSpec())
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f.urls[0] + "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"endpoint-load-metrics-format": fmt},
        ) as r:
            header = r.headers["endpoint-load-metrics"]
        async with s.post(
            f.urls[0] + "/v1/completions", json={"prompt": "x", "max_tokens": 1}
        ) as r:
            assert "endpoint-load-metrics" not in r.headers
    if fmt == "TEXT":
        assert header == (
            "TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc=0.0"
        )
    else:
        assert header.startswith("JSON ")
        assert json.loads(header[5:]) == {
            "named_metrics": {"num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}
        }


async def test_models_health_version_tokenize(fleet: Any) -> None:
    f = await fleet(EngineSpec(max_model_len=4096))
    models = await client(f.urls[0]).models.list()
    assert [m.id for m in models.data] == [DEFAULT_MODEL]
    assert models.data[0].owned_by == "vllm"
    async with aiohttp.ClientSession() as s:
        async with s.get(f.urls[0] + "/health") as r:
            assert r.status == 200
        async with s.get(f.urls[0] + "/version") as r:
            assert "version" in await r.json()
        async with s.post(f.urls[0] + "/tokenize", json={"prompt": "Hello, world!"}) as r:
            tok = await r.json()
        assert tok["count"] == 4 and tok["max_model_len"] == 4096
        async with s.post(f.urls[0] + "/detokenize", json={"tokens": tok["tokens"]}) as r:
            assert (await r.json())["prompt"] == "Hello, world!"
        async with s.post(
            f.urls[0] + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
        ) as r:
            assert (await r.json())["count"] > 3


async def test_metrics_parse_and_carry_vllm_names(fleet: Any) -> None:
    f = await fleet(EngineSpec(gpu="B200", kv_blocks=500))
    c = client(f.urls[0])
    prompt = " ".join(f"t{i}" for i in range(64))
    for _ in range(2):
        await c.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=5)
    async with aiohttp.ClientSession() as s, s.get(f.urls[0] + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await r.text()
    families = {fam.name: fam for fam in text_string_to_metric_families(text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_requests_waiting_by_reason": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens_cached": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:iteration_tokens_total": "histogram",
        "vllm:cache_config_info": "gauge",
    }
    for name, mtype in expected.items():
        assert name in families, name
        assert families[name].type == mtype, name

    def value(name: str, sample: str, **labels: str) -> float:
        for smp in families[name].samples:
            if smp.name == sample and all(smp.labels.get(k) == v for k, v in labels.items()):
                return smp.value
        raise AssertionError(f"{sample} {labels} missing")

    labels = {"engine": "0", "model_name": DEFAULT_MODEL}
    assert value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total", **labels) == 128
    assert value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", **labels) == 48
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 10
    assert (
        value("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    )
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 2
    assert (
        value(
            "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_bucket", le="+Inf"
        )
        == 2
    )
    assert value("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 8
    assert value("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0.0
    assert (
        value(
            "vllm:cache_config_info",
            "vllm:cache_config_info",
            block_size="16",
            num_gpu_blocks="500",
        )
        == 1.0
    )
    info = families["meshd_sim:engine_info"].samples[0].labels
    assert info["gpu"] == "B200" and float(info["price_per_gpu_hour"]) > 0


async def test_continuous_usage_stats_on_every_chunk(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    # vLLM's extension of stream_options, unknown to the openai client's types.
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    stream = await client(f.urls[0]).completions.create(
        model=DEFAULT_MODEL, prompt="a b", max_tokens=4, stream=True, stream_options=options
    )
    chunks = [ch async for ch in stream]
    assert [ch.usage.completion_tokens for ch in chunks if ch.usage] == [1, 2, 3, 4, 4]


async def test_a_client_that_goes_away_aborts_its_request(fleet: Any) -> None:
    f = await fleet(EngineSpec(), time_scale=10.0)
    engine = f[0]
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            engine.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2000, "stream": True}
        )
        await r.content.readline()
        (req,) = engine.core.requests()
        r.close()  # drops the connection mid-stream
        # The handler's future resolves (the sink saw the closed transport) or is
        # cancelled (aiohttp cancelled the handler); either way the request is over.
        await asyncio.wait([req.waiter.done], timeout=10)
    assert req.finish_reason == "abort" and req.num_output_tokens < 2000
    assert engine.core.num_running == 0 and engine.core.stats.request_success["abort"] == 1
