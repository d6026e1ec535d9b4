"""The sidecar against real aiohttp backends: relaying, limits, failures."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from backends import sse_events
from harness import sidecar_config, url
from prometheus_client.parser import text_string_to_metric_families

from filters.chars_per_token import MIN_SAMPLES
from meshd.sidecar import Sidecar


async def post(
    session: aiohttp.ClientSession,
    target: str,
    body: object,
    headers: dict[str, str] | None = None,
) -> aiohttp.ClientResponse:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await session.post(
        target, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )


async def test_streamed_completion_is_relayed_chunk_for_chunk(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        req = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
        resp = await post(http, url(s, "/v1/completions"), req)
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        events = sse_events(await resp.read())
    assert "".join(e["choices"][0]["text"] for e in events[:4]) == "w0 w1 w2 w3"
    assert events[4]["usage"]["completion_tokens"] == 4
    assert events[-1] == "[DONE]"
    seen = b.requests[-1]
    assert seen.headers["via"] == "1.1 meshd"
    assert seen.body == req
    assert "x-request-id" in {k.lower() for k in seen.headers}
    families = {
        f.name: f for f in text_string_to_metric_families((await _admin(s, "/metrics")).decode())
    }
    tokens = [x for x in families["meshd_stream_tokens"].samples if x.name.endswith("_total")]
    assert tokens[0].value == 4
    ttft = families["meshd_time_to_first_token_seconds"]
    assert [x.value for x in ttft.samples if x.name.endswith("_count")] == [1]


async def test_non_streamed_chat_is_relayed_whole(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        req = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        resp = await post(http, url(s, "/v1/chat/completions"), req)
        doc = await resp.json()
    assert resp.status == 200
    assert doc["choices"][0]["message"]["content"] == "w0 w1 w2"
    assert resp.headers["x-meshd-endpoint"] == b.url


async def test_client_disconnect_cancels_the_upstream_request(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        req = {"model": "tiny", "prompt": "hang", "max_tokens": 10, "stream": True}
        resp = await post(http, url(s, "/v1/completions"), req)
        first = await resp.content.readany()
        assert first.startswith(b"data: ")
        resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(b.cancelled.wait(), 5)
    metrics = (await _admin(s, "/metrics")).decode()
    assert 'meshd_client_disconnects_total{pool="default"} 1.0' in metrics


async def test_backend_crash_mid_stream_ends_with_an_sse_error_event(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        req = {"model": "tiny", "prompt": "crash", "max_tokens": 10, "stream": True}
        resp = await post(http, url(s, "/v1/completions"), req)
        events = sse_events(await asyncio.wait_for(resp.read(), 5))
    assert [e["choices"][0]["text"] for e in events[:2]] == ["w0", " w1"]
    assert events[-1]["error"]["code"] == "upstream_stream_broken"
    assert events[-1]["error"]["type"] == "upstream_error"


async def test_stream_closed_without_done_is_reported(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url], reliability={"failover": {"enabled": False}}))
    async with aiohttp.ClientSession() as http:
        req = {"model": "tiny", "prompt": "no-done", "max_tokens": 2, "stream": True}
        events = sse_events(await (await post(http, url(s, "/v1/completions"), req)).read())
    assert events[-1]["error"]["code"] == "upstream_stream_truncated"


async def test_stream_cut_after_its_last_token_is_ended_by_failover(backends, sidecar):
    # Every token max_tokens allowed reached the client before the engine closed without
    # a finish: failover has nothing left to generate and ends the stream itself.
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        req = {"model": "tiny", "prompt": "no-done", "max_tokens": 2, "stream": True}
        events = sse_events(await (await post(http, url(s, "/v1/completions"), req)).read())
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["id"] == "cmpl-test"
    assert "created" not in events[-2]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "w0 w1"


@pytest.mark.parametrize("chunked", [False, True])
async def test_oversized_body_is_refused_with_413(backends, sidecar, chunked):
    b = await backends()
    s = await sidecar(sidecar_config([b.url], limits={"max_body_bytes": 2048}))
    body = json.dumps({"model": "tiny", "prompt": "x" * 5000}).encode()

    async def gen():
        yield body

    async with aiohttp.ClientSession() as http:
        resp = await http.post(url(s, "/v1/completions"), data=gen() if chunked else body)
        doc = await resp.json()
    assert resp.status == 413
    assert doc["error"]["code"] == "body_too_large"
    assert "limits.max_body_bytes" in doc["error"]["message"]
    assert b.requests == []


async def test_malformed_json_gets_a_clear_400(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        resp = await post(http, url(s, "/v1/completions"), b'{"model": "tiny", "prompt": ')
        doc = await resp.json()
        assert resp.status == 400
        assert "not valid JSON" in doc["error"]["message"]
        assert doc["error"]["type"] == "invalid_request_error"
        resp = await post(http, url(s, "/v1/chat/completions"), {"model": "tiny"})
        doc = await resp.json()
        assert resp.status == 400 and doc["error"]["param"] == "messages"
        # ...and the next, valid request on the same sidecar is served.
        resp = await post(http, url(s, "/v1/completions"), {"model": "tiny", "prompt": "ok"})
        assert resp.status == 200
    assert len(b.requests) == 1


async def test_too_many_or_too_large_headers_get_431(backends, sidecar):
    b = await backends()
    s = await sidecar(
        sidecar_config([b.url], limits={"max_header_count": 10, "max_header_bytes": 2048})
    )
    async with aiohttp.ClientSession() as http:
        many = {f"x-extra-{i}": "v" for i in range(12)}
        resp = await post(
            http, url(s, "/v1/completions"), {"model": "tiny", "prompt": "a"}, headers=many
        )
        assert resp.status == 431
        assert (await resp.json())["error"]["code"] == "header_count_exceeded"
        big = {"x-big": "v" * 1900, "x-big2": "v" * 500}
        resp = await post(
            http, url(s, "/v1/completions"), {"model": "tiny", "prompt": "a"}, headers=big
        )
        assert resp.status == 431
        assert (await resp.json())["error"]["code"] == "header_size_exceeded"
    assert b.requests == []


async def test_slow_client_body_times_out_and_others_are_served(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url], limits={"client_body_timeout_s": 0.3}))
    host, port = s.addresses["outbound"].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model":'
    )
    await writer.drain()
    async with aiohttp.ClientSession() as http:
        resp = await post(http, url(s, "/v1/completions"), {"model": "tiny", "prompt": "a"})
        assert resp.status == 200
    head = await asyncio.wait_for(reader.read(4096), 5)
    writer.close()
    assert head.startswith(b"HTTP/1.1 408")
    assert b"body_timeout" in head


async def test_dead_engine_is_skipped_and_all_dead_gives_502(backends, sidecar):
    b = await backends()
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    s = await sidecar(sidecar_config([dead, b.url], routing={"policy": "round-robin"}))
    async with aiohttp.ClientSession() as http:
        for _ in range(4):
            resp = await post(http, url(s, "/v1/completions"), {"model": "tiny", "prompt": "a"})
            assert resp.status == 200
    s2 = await sidecar(sidecar_config([dead]))
    async with aiohttp.ClientSession() as http:
        resp = await post(http, url(s2, "/v1/completions"), {"model": "tiny", "prompt": "a"})
        doc = await resp.json()
    assert resp.status == 502
    assert doc["error"]["code"] == "upstream_unavailable"
    assert "127.0.0.1:9" in doc["error"]["message"]


async def test_routing_headers_stripped_from_untrusted_clients(backends, sidecar):
    b = await backends()
    hdrs = {"x-meshd-tenant": "acme", "x-meshd-priority": "high"}
    untrusted = await sidecar(
        sidecar_config([b.url], trust={"routing_header_sources": ["192.0.2.0/24"]})
    )
    trusted = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "a"}
        resp = await post(http, url(untrusted, "/v1/completions"), body, headers=hdrs)
        assert resp.status == 200
        assert "x-meshd-endpoint" not in resp.headers
        assert not {k.lower() for k in b.requests[-1].headers} & set(hdrs)
        resp = await post(http, url(trusted, "/v1/completions"), body, headers=hdrs)
        assert resp.status == 200
        assert b.requests[-1].headers["x-meshd-tenant"] == "acme"
        bad = {"x-meshd-priority": "urgent!"}
        resp = await post(http, url(trusted, "/v1/completions"), body, headers=bad)
        doc = await resp.json()
    assert resp.status == 400
    assert "x-meshd-priority" in doc["error"]["message"]


async def test_models_are_merged_across_the_pool(backends, sidecar):
    b1 = await backends("one", ("tiny", "small"))
    b2 = await backends("two", ("small", "large"))
    s = await sidecar(sidecar_config([b1.url, b2.url, "http://127.0.0.1:9"]))
    async with aiohttp.ClientSession() as http:
        doc = await (await http.get(url(s, "/v1/models"))).json()
    assert sorted(m["id"] for m in doc["data"]) == ["large", "small", "tiny"]


async def test_other_paths_pass_through_to_the_pool(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        resp = await http.post(url(s, "/tokenize?x=1"), json={"prompt": "a"})
        doc = await resp.json()
    assert doc == {"path": "/tokenize", "backend": "b"}


async def test_unknown_model_gets_404(backends, sidecar):
    b = await backends()
    cfg = sidecar_config([b.url])
    cfg = cfg.model_copy(update={"pools": (cfg.pools[0].model_copy(update={"models": ("tiny",)}),)})
    s = await sidecar(cfg)
    async with aiohttp.ClientSession() as http:
        resp = await post(http, url(s, "/v1/completions"), {"model": "gpt-9", "prompt": "a"})
        doc = await resp.json()
    assert resp.status == 404 and doc["error"]["code"] == "model_not_found"


async def test_first_byte_timeout_gives_504(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url], upstream={"first_byte_timeout_s": 0.2}))
    async with aiohttp.ClientSession() as http:
        resp = await post(
            http, url(s, "/v1/completions"), {"model": "tiny", "prompt": "slow-headers"}
        )
        doc = await resp.json()
    b.release.set()
    assert resp.status == 504
    assert "first_byte_timeout_s" in doc["error"]["message"]


async def test_an_engine_that_never_answers_is_passed_over_after_the_per_try_timeout(
    backends, sidecar
):
    # Found by the fault campaign: an engine that accepts and never answers (SIGSTOPped)
    # cost its requests a 504 after first_byte_timeout_s though others were free. As with
    # Envoy's per-try timeout, the next endpoint gets the request, within the retry budget.
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    hung = f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    b = await backends()
    # Round robin: one of the two requests meets the silent engine first, whatever the ports.
    cfg = sidecar_config(
        [hung, b.url], upstream={"first_byte_timeout_s": 0.3}, routing={"policy": "round-robin"}
    )
    s = await sidecar(cfg)
    try:
        async with aiohttp.ClientSession() as http:
            answers = []
            for i in range(2):
                body = {"model": "tiny", "prompt": f"question {i}"}
                resp = await post(http, url(s, "/v1/completions"), body)
                answers.append(resp.status)
                await resp.read()
        assert answers == [200, 200] and len(b.requests) == 2
        timeouts = s.metrics.registry.get_sample_value(
            "meshd_upstream_attempts_total",
            {"pool": "default", "endpoint": hung, "result": "timeout"},
        )
        assert timeouts and timeouts >= 1  # at least one answer came after a timed-out try
    finally:
        silent.close()


async def test_idle_upstream_mid_stream_ends_with_timeout_event(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url], upstream={"idle_timeout_s": 0.3}))
    async with aiohttp.ClientSession() as http:
        req = {"model": "tiny", "prompt": "stall", "max_tokens": 5, "stream": True}
        events = sse_events(
            await asyncio.wait_for((await post(http, url(s, "/v1/completions"), req)).read(), 5)
        )
    b.release.set()
    assert events[0]["choices"][0]["text"] == "w0"
    assert events[-1]["error"]["code"] == "upstream_timeout"
    assert "idle_timeout_s" in events[-1]["error"]["message"]


async def test_concurrency_limit_gives_503_with_retry_after(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url], limits={"max_concurrent_streams": 1}))
    async with aiohttp.ClientSession() as http:
        req = {"model": "tiny", "prompt": "stall", "max_tokens": 3, "stream": True}
        first = await post(http, url(s, "/v1/completions"), req)
        await first.content.readany()
        resp = await post(http, url(s, "/v1/completions"), {"model": "tiny", "prompt": "a"})
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "overloaded"
        b.release.set()
        assert sse_events(await first.read())[-1] == "[DONE]"


async def test_admin_endpoints(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    assert s.addresses["admin"].startswith("127.0.0.1:")
    assert json.loads(await _admin(s, "/healthz")) == {"status": "ok"}
    ready = json.loads(await _admin(s, "/readyz"))
    assert ready["ready"] is True
    cfg = json.loads(await _admin(s, "/config"))
    assert cfg["pools"][0]["endpoints"][0]["url"] == b.url


async def test_admin_config_redacts_secrets(backends, sidecar):
    # Issue #21: /config showed telemetry.tracing.headers.authorization in clear.
    b = await backends()
    tracing = {"headers": {"authorization": "Bearer s3cret", "x-honeycomb-team": "k3y"}}
    s = await sidecar(sidecar_config([b.url], telemetry={"tracing": tracing}))
    raw = await _admin(s, "/config")
    assert b"s3cret" not in raw and b"k3y" not in raw
    headers = json.loads(raw)["telemetry"]["tracing"]["headers"]
    assert headers == {"authorization": "<redacted>", "x-honeycomb-team": "<redacted>"}
    assert json.loads(raw)["pools"][0]["endpoints"][0]["url"] == b.url  # the rest as is
    eps = json.loads(await _admin(s, "/endpoints"))
    assert eps["pools"]["default"][0]["healthy"] is True


async def _admin(s, path: str) -> bytes:
    async with aiohttp.ClientSession() as http, http.get(url(s, path, "admin")) as resp:
        return await resp.read()


async def test_transparent_listener_routes_by_original_destination_and_refuses_loops(
    backends, sidecar
):
    b = await backends()
    host, port = b.url.removeprefix("http://").split(":")
    cfg = sidecar_config(
        [b.url],
        listeners={"transparent": {"enabled": True, "host": "127.0.0.1", "port": 0}},
        transparent={"services": [{"address": f"{host}:{port}", "pool": "default"}]},
    )
    # No iptables here: every connection "was headed for" the backend's address.
    s = Sidecar(cfg, original_destination_fn=lambda sock: (host, int(port)))
    await s.start()
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "a"}
            target = url(s, "/v1/completions", "transparent")
            resp = await post(http, target, body)
            assert resp.status == 200
            assert b.requests[-1].headers["via"] == "1.1 meshd"
            resp = await post(http, target, body, headers={"via": "1.1 meshd"})
            doc = await resp.json()
        assert resp.status == 508
        assert "--proxy-uid" in doc["error"]["message"]
        assert len(b.requests) == 1
    finally:
        await s.drain_and_stop()


async def test_a_refusal_before_the_first_byte_is_retried_on_another_endpoint(backends, sidecar):
    busy, ok = await backends("busy"), await backends("ok")
    busy.refuse_with = 503
    s = await sidecar(sidecar_config([busy.url, ok.url], routing={"policy": "round-robin"}))
    async with aiohttp.ClientSession() as http:
        for _ in range(4):
            req = {"model": "tiny", "prompt": "a", "stream": True, "max_tokens": 2}
            resp = await post(http, url(s, "/v1/completions"), req)
            assert resp.status == 200
            assert sse_events(await resp.read())[-1] == "[DONE]"
    assert len(ok.requests) == 4
    assert len(busy.requests) == 2  # round robin offered it every other request
    metrics = (await _admin(s, "/metrics")).decode()
    assert 'meshd_retries_total{pool="default",reason="503"} 2.0' in metrics


async def test_without_retry_budget_the_refusal_reaches_the_client(backends, sidecar):
    busy, ok = await backends("busy"), await backends("ok")
    busy.refuse_with = 503
    s = await sidecar(
        sidecar_config(
            [busy.url, ok.url],
            routing={"policy": "round-robin"},
            reliability={"retry": {"ratio": 0.0, "min_retries_per_s": 0.0}},
        )
    )
    statuses = []
    async with aiohttp.ClientSession() as http:
        for _ in range(4):
            resp = await post(http, url(s, "/v1/completions"), {"model": "tiny", "prompt": "a"})
            statuses.append(resp.status)
            if resp.status == 503:
                assert (await resp.json())["error"]["message"] == "busy"  # the engine's own
    assert sorted(statuses) == [200, 200, 503, 503]
    metrics = (await _admin(s, "/metrics")).decode()
    assert 'meshd_retry_budget_exhausted_total{pool="default"} 2.0' in metrics


async def test_retries_stay_within_the_budget_when_every_engine_refuses(backends, sidecar):
    a, b = await backends("a"), await backends("b")
    a.refuse_with = b.refuse_with = 429
    s = await sidecar(
        sidecar_config(
            [a.url, b.url],
            # The client-side throttle would answer most of these itself.
            reliability={
                "retry": {"ratio": 0.2, "min_retries_per_s": 0.1, "window_s": 10},
                "throttle": {"enabled": False},
            },
        )
    )
    async with aiohttp.ClientSession() as http:
        for _ in range(20):
            resp = await post(http, url(s, "/v1/completions"), {"model": "tiny", "prompt": "a"})
            assert resp.status == 429
    attempts = len(a.requests) + len(b.requests)
    # 20 requests; the budget allows 0.2 x 20 + 0.1 x 10 = 5 retries at most.
    assert 20 < attempts <= 25, attempts


async def test_stream_broken_mid_way_resumes_on_another_endpoint(backends, sidecar):
    # Both engines crash after two tokens of a prompt that is exactly "crash"; the
    # continuation's prompt is "crash" + the text already sent, so the second engine
    # finishes it. The client sees one stream: one id, no error, corrected usage.
    a, b = await backends("a"), await backends("b")
    s = await sidecar(sidecar_config([a.url, b.url]))
    async with aiohttp.ClientSession() as http:
        req = {
            "model": "tiny",
            "prompt": "crash",
            "max_tokens": 10,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        resp = await post(http, url(s, "/v1/completions"), req)
        events = sse_events(await asyncio.wait_for(resp.read(), 5))
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    assert {e["id"] for e in events[:-1]} == {"cmpl-test"}
    texts = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
    assert texts[:2] == ["w0", " w1"] and len(texts) == 10
    (usage,) = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert usage["completion_tokens"] == 10
    crashed, resumed = (a, b) if a.requests[0].body["prompt"] == "crash" else (b, a)
    assert len(crashed.requests) == 1
    cont = resumed.requests[-1].body
    assert cont["prompt"] == "crashw0 w1" and cont["max_tokens"] == 8
    async with aiohttp.ClientSession() as http:
        metrics = await (await http.get(url(s, "/metrics", "admin"))).text()
    assert 'meshd_stream_resumes_total{outcome="resumed",pool="default"} 1.0' in metrics
    # Each attempt counted as it ended: the broken one is no "200", the continuation counts.
    series = 'meshd_upstream_attempts_total{{endpoint="{}",pool="default",result="{}"}}'
    broken = series.format(crashed.url, "stream_broken") + " 1.0"
    cont_ok = series.format(resumed.url, "200") + " 1.0"
    assert broken in metrics and cont_ok in metrics
    assert f'endpoint="{crashed.url}",pool="default",result="200"' not in metrics


async def test_failing_engine_trips_its_breaker_and_traffic_moves(backends, sidecar):
    a, b = await backends("a"), await backends("b")
    a.refuse_with = 500
    s = await sidecar(
        sidecar_config(
            [a.url, b.url],
            routing={"policy": "round-robin"},
            reliability={"breaker": {"consecutive_failures": 2, "open_base_s": 60}},
        )
    )
    async with aiohttp.ClientSession() as http:
        statuses = []
        for _ in range(12):
            resp = await post(http, url(s, "/v1/completions"), {"model": "tiny", "prompt": "x"})
            statuses.append(resp.status)
        # Only the first tries reached the failing engine: its breaker opened after two.
        assert len(a.requests) == 2
        assert statuses.count(200) >= 10
        # The gauge follows at the next reaper sweep.
        want = f'meshd_breaker_state{{endpoint="{a.url}",pool="default"}} 2.0'
        deadline = asyncio.get_running_loop().time() + 5
        while want not in (metrics := await (await http.get(url(s, "/metrics", "admin"))).text()):
            assert asyncio.get_running_loop().time() < deadline, metrics
            await asyncio.sleep(0.05)


async def test_usage_teaches_the_picker_the_models_chars_per_token(backends, sidecar):
    # A backend whose usage counts 2 characters per prompt token: after MIN_SAMPLES answers
    # the picker's estimate of a 400-character prompt is 200 tokens, not 100, and a
    # 64-byte block holds 32 tokens.
    b = await backends()
    b.chars_per_token = 2.0
    s = await sidecar(sidecar_config([b.url], routing={"learn_chars_per_token": True}))
    router = s.routers["default"]
    picks = []
    order = router.order
    router.order = lambda pick, now: (picks.append(pick), order(pick, now))[1]  # type: ignore[method-assign]
    prompt = "abcd " * 80
    async with aiohttp.ClientSession() as http:
        for i in range(MIN_SAMPLES + 1):
            req = {
                "model": "tiny",
                "prompt": prompt[:-1] + str(i),
                "max_tokens": 2,
                "stream": i % 2 == 0,
            }
            resp = await post(http, url(s, "/v1/completions"), req)
            assert resp.status == 200
            await resp.read()
    assert [p.prompt_tokens for p in picks[:MIN_SAMPLES]] == [100] * MIN_SAMPLES
    assert picks[0].tokens_per_block is None
    assert picks[-1].prompt_tokens == 200 and picks[-1].tokens_per_block == 32.0
    eps = json.loads(await _admin(s, "/endpoints"))
    assert eps["chars_per_token"]["tiny"] == {
        "chars_per_token": 2.0,
        "bytes_per_token": 2.0,
        "samples": MIN_SAMPLES + 1,
    }


async def test_chars_per_token_learning_is_off_by_default(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    assert s.chars_per_token is None
    assert json.loads(await _admin(s, "/endpoints"))["chars_per_token"] is None
