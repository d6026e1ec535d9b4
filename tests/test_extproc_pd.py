# ruff: noqa: F811  (the `engines` fixture, imported from test_sidecar_disagg, is a parameter)
"""Prefill/decode disaggregation behind Envoy (meshd/extproc_pd.py): the real Envoy, `meshd
picker` with prefill endpoints, a meshd sidecar in front of each decode engine (the
decode-side proxy that runs the prefill step, meshd/disagg.py) and engines speaking vLLM's
NIXL protocol. A long prompt's prefill step lands on the prefill engine the picker named
(x-gateway-prefill-endpoints / x-prefiller-host-port) and its decode step, with that
engine's kv_transfer_params, on the decode engine behind the endpoint the picker chose;
a short one is served whole there; a client cannot name a prefill engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from backends import sse_events
from harness import envoy_only, sidecar_config
from test_sidecar_disagg import (
    LONG,
    PDEngine,
    ask,
    count,
    engines,  # noqa: F401  (the fixture; tests take it as a parameter)
    pd_config,
    post,
)

from filters.disagg import PREFILL_HEADERS
from filters.pool_router import PickerRouter
from loadtest.envoy_bin import EnvoyProcess, start_envoy
from loadtest.extproc_bench import render_extproc_config
from meshd.extproc import PickerServer, endpoint_spec
from meshd.extproc_messages import DESTINATION_HEADER
from meshd.extproc_pd import PdSettings
from meshd.extproc_picker import Decision, PickerSettings
from meshd.sidecar import Sidecar


def addr(url: str) -> str:
    return url.split("://", 1)[-1]


@dataclass
class PDRig:
    prefill: list[PDEngine]
    decode: list[PDEngine]
    sidecars: list[Sidecar]  # sidecars[i] fronts decode[i]
    picker: PickerServer
    envoy: EnvoyProcess
    session: aiohttp.ClientSession
    decisions: list[Decision] = field(default_factory=list)

    async def chat(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        host, port = self.envoy.listener
        async with self.session.post(
            f"http://{host}:{port}/v1/chat/completions", json=body, headers=headers or {}
        ) as resp:
            return resp.status, await resp.read()

    def behind(self, destination: str) -> tuple[Sidecar, PDEngine]:
        (i,) = [i for i, s in enumerate(self.sidecars) if s.addresses["outbound"] == destination]
        return self.sidecars[i], self.decode[i]


@pytest.fixture
async def pd_rig(
    tmp_path: Path, sidecar: Callable[..., Awaitable[Sidecar]]
) -> AsyncIterator[Callable[[], Awaitable[PDRig]]]:
    made: list[PDRig] = []
    engines: list[PDEngine] = []

    async def make() -> PDRig:
        fabric: dict[str, str] = {}

        async def engine(name: str) -> PDEngine:
            e = PDEngine(name)
            e.fabric = fabric
            await e.start()
            engines.append(e)
            return e

        prefill = [await engine("p0"), await engine("p1")]
        decode = [await engine("d0"), await engine("d1")]
        urls = [p.url for p in prefill]
        sidecars = [await sidecar(pd_config(urls, [d.url])) for d in decode]
        fronts = [s.addresses["outbound"] for s in sidecars]
        settings = PickerSettings(
            endpoints=tuple(endpoint_spec(f"{a}=H100") for a in fronts),
            drain_grace_s=0.5,
            pd=PdSettings(
                tuple(endpoint_spec(f"{addr(u)}=H100") for u in urls), min_prefill_tokens=64
            ),
        )
        picker = PickerServer(settings, "127.0.0.1:0")
        port = await picker.start()
        backends = [(h, int(p)) for h, _, p in (a.rpartition(":") for a in fronts)]
        config = render_extproc_config(("127.0.0.1", port), backends)
        envoy = await asyncio.to_thread(start_envoy, config, tmp_path / f"envoy{len(made)}")
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        rig = PDRig(prefill, decode, sidecars, picker, envoy, session)
        picker.picker.on_decision = rig.decisions.append
        made.append(rig)
        return rig

    yield make
    for r in made:
        await r.session.close()
        r.envoy.stop()
        await r.picker.kill()
    for e in engines:
        await e.stop()


def outstanding(router: Any) -> int:
    assert isinstance(router, PickerRouter)
    return sum(s.outstanding for s in router.states)


@envoy_only
async def test_a_long_prompt_is_prefilled_where_the_picker_named_and_decoded_behind_envoy(
    pd_rig: Callable[[], Awaitable[PDRig]],
) -> None:
    r = await pd_rig()
    for i in range(2):
        status, raw = await r.chat(ask(f"{i} " + LONG, stream=True))
        assert status == 200, raw
        assert sse_events(raw)[-1] == "[DONE]"
        d = r.decisions[-1]
        assert d.pd is not None and d.pd.split and d.pd.reason == "split"
        (named,) = d.prefill
        (p,) = [p for p in r.prefill if p.url == named.url]
        step = p.requests[-1]
        assert step.body is not None and step.body["max_tokens"] == 1
        assert step.body["kv_transfer_params"]["do_remote_decode"] is True
        sidecar, engine = r.behind(d.destination)
        dec = engine.requests[-1]
        assert dec.body is not None and dec.body["stream"] is True and dec.body["max_tokens"] == 4
        assert dec.body["kv_transfer_params"]["remote_engine_id"] == p.name
        assert dec.body["kv_transfer_params"]["remote_block_ids"] == [f"{p.name}-{len(p.requests)}"]
        # The picker's headers came through Envoy to the decode endpoint, and stop there.
        assert not set(PREFILL_HEADERS) & (set(dec.headers) | set(step.headers))
        assert dec.headers[DESTINATION_HEADER] == d.destination
        labels = {"pool": "decode", "path": "split", "reason": "picker"}
        assert count(sidecar, "meshd_pd_requests_total", **labels) >= 1
    assert sum(len(p.requests) for p in r.prefill) == 2  # one prefill step a request
    assert sum(len(e.requests) for e in r.decode) == 2  # one decode step a request
    # The prefill engine was charged from the pick to the decode answer's head.
    assert r.picker.picker.pd is not None
    assert outstanding(r.picker.picker.pd.router) == 0


@envoy_only
async def test_a_short_prompt_goes_whole_and_a_client_cannot_name_a_prefill_engine(
    pd_rig: Callable[[], Awaitable[PDRig]],
) -> None:
    r = await pd_rig()
    evil = r.prefill[1]
    for headers in ({}, {h: addr(evil.url) for h in PREFILL_HEADERS}):
        status, raw = await r.chat(ask("hi"), headers)
        assert status == 200, raw
        d = r.decisions[-1]
        assert d.pd is not None and d.pd.reason == "short-prefill" and d.prefill == ()
        _, engine = r.behind(d.destination)
        seen = engine.requests[-1]
        assert seen.body is not None and "kv_transfer_params" not in seen.body
        assert not set(PREFILL_HEADERS) & set(seen.headers)
    assert all(p.requests == [] for p in r.prefill)
    whole = sum(
        count(s, "meshd_pd_requests_total", pool="decode", path="whole", reason="picker")
        for s in r.sidecars
    )
    assert whole == 2


# -- the decode-side sidecar alone (meshd/disagg.py) ---------------------------------------------


async def _picked(s: Sidecar, body: dict[str, Any], **headers: str) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"http://{s.addresses['outbound']}/v1/chat/completions", json=body, headers=headers
        ) as resp,
    ):
        return resp.status, await resp.read()


async def test_the_sidecar_prefills_on_the_named_engine_even_for_a_short_prompt(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    p0, p1, d = await engines("p0"), await engines("p1"), await engines("d0")
    s = await sidecar(pd_config([p0.url, p1.url], [d.url]))
    picked = {DESTINATION_HEADER: addr(d.url), "x-prefiller-host-port": addr(p1.url)}
    status, _ = await _picked(s, ask("hi"), **picked)  # the picker decided: no decider here
    assert status == 200 and p0.requests == [] and len(p1.requests) == 1
    assert (d.requests[-1].body or {})["kv_transfer_params"]["remote_engine_id"] == "p1"
    # GIE's header is read first; a list is tried in order.
    gie = {DESTINATION_HEADER: addr(d.url), "x-gateway-prefill-endpoints": addr(p0.url)}
    status, _ = await _picked(s, ask("hi"), **gie, **{"x-prefiller-host-port": addr(p1.url)})
    assert status == 200 and len(p0.requests) == 1 and len(p1.requests) == 1


async def test_the_sidecar_never_sends_a_prefill_step_outside_its_prefill_pool(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    p0, outsider, d = await engines("p0"), await engines("x"), await engines("d0")
    s = await sidecar(pd_config([p0.url], [d.url]))
    named = {DESTINATION_HEADER: addr(d.url), "x-prefiller-host-port": addr(outsider.url)}
    status, _ = await _picked(s, ask(), **named)
    assert status == 200 and outsider.requests == [] and p0.requests == []
    assert "kv_transfer_params" not in (d.requests[-1].body or {})
    labels = {"pool": "decode", "path": "whole", "reason": "no-prefill-engine"}
    assert count(s, "meshd_pd_requests_total", **labels) == 1


async def test_without_a_picker_or_from_an_untrusted_peer_the_sidecar_decides(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    p0, p1, d = await engines("p0"), await engines("p1"), await engines("d0")
    urls = [p0.url, p1.url]
    # A prefill header without the destination header: no picker routed it.
    s = await sidecar(pd_config(urls, [d.url]))
    status, _ = await post(s, ask("hi"))
    assert status == 200 and p0.requests == p1.requests == []
    status, _ = await _picked(s, ask("hi"), **{"x-prefiller-host-port": addr(p1.url)})
    assert status == 200 and p0.requests == p1.requests == []
    # An untrusted peer's headers name nothing either (and are not passed on).
    base = pd_config(urls, [d.url])
    pools = [p.model_dump(exclude_none=True) for p in base.pools]
    untrusted = sidecar_config(
        [d.url], pools=pools, trust={"routing_header_sources": ["10.0.0.0/8"]}
    )
    u = await sidecar(untrusted)
    named = {DESTINATION_HEADER: addr(d.url), "x-prefiller-host-port": addr(p1.url)}
    status, _ = await _picked(u, ask("hi"), **named)
    assert status == 200 and p1.requests == []
    assert "x-prefiller-host-port" not in d.requests[-1].headers


def test_the_prefill_header_is_read_in_order_with_limits() -> None:
    from filters.disagg import MAX_NAMED_PREFILL, named_prefill_endpoints

    assert named_prefill_endpoints([("Host", "x")]) == ()
    assert named_prefill_endpoints([("X-Prefiller-Host-Port", " 10.0.0.1:80 ")]) == ("10.0.0.1:80",)
    # GIE's header wins; several lines and comma lists are one list, repeats dropped.
    headers = [
        ("x-prefiller-host-port", "10.0.0.9:80"),
        ("x-gateway-prefill-endpoints", "10.0.0.1:80,10.0.0.2:80"),
        ("x-gateway-prefill-endpoints", "10.0.0.1:80, ,10.0.0.3:80"),
    ]
    assert named_prefill_endpoints(headers) == ("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80")
    many = ",".join(f"10.0.0.{i}:80" for i in range(20))
    assert len(named_prefill_endpoints([("x-prefiller-host-port", many)])) == MAX_NAMED_PREFILL


def _pd_picker(tracer: Any = None, **pd: Any) -> Any:
    from meshd.extproc_picker import EndpointPicker

    settings = PickerSettings(
        endpoints=(endpoint_spec("10.0.1.1:8000=H100"),),
        pd=PdSettings((endpoint_spec("10.0.0.1:8000=H100"), endpoint_spec("10.0.0.2:8000=H100")),
                      min_prefill_tokens=64, **pd),
    )  # fmt: skip
    return EndpointPicker(settings, tracer=tracer)


def _decide_pd(p: Any, content: str) -> Any:
    import json as _json

    from meshd.extproc_picker import _Stream

    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 64}
    s = _Stream(rid=next(p._rids), path="/v1/chat/completions",
                headers=[("content-type", "application/json")])  # fmt: skip
    p._decide(s, _json.dumps(body).encode(), "request_body")
    return s


def test_the_decision_span_names_the_prefill_endpoint_and_the_transfer() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from meshd.telemetry import setup_tracing

    exporter = InMemorySpanExporter()
    provider = setup_tracing("meshd-picker", None, exporter=exporter)
    p = _pd_picker(provider.get_tracer("test"))
    for s in (_decide_pd(p, "tell me " * 400), _decide_pd(p, "hi")):
        p._close(s)
    provider.force_flush()
    split, whole = (dict(x.attributes or {}) for x in exporter.get_finished_spans())
    named = split["meshd.pd.prefill_endpoints"]
    assert split["meshd.pd"] == "split" and named[0] in ("10.0.0.1:8000", "10.0.0.2:8000")
    assert split["meshd.pd.kv_transfer_s"] > 0 and split["meshd.pd.prefill_predicted_ttft_s"] > 0
    assert whole["meshd.pd"] == "whole:short-prefill"
    assert "meshd.pd.prefill_endpoints" not in whole


@pytest.mark.parametrize(("margin", "prefill_named"), [(0.3, False), (None, True)])
def test_a_queued_prefill_pool_sends_the_request_whole_behind_envoy_too(
    margin: float | None, prefill_named: bool
) -> None:
    # The decider's rule 4 on the picker's path: both prefill endpoints have ~3 s of
    # prompts queued (as the picker sees them), the decode endpoint is idle.
    from filters.picker import PickRequest

    p = _pd_picker(faster_whole_margin_s=margin)
    assert p.pd is not None
    router = p.pd.router
    for i in range(12):
        queued = PickRequest(model="m", prompt_tokens=16_000, max_tokens=1)
        (route, *_) = router.order(queued, 0.0)
        router.started(route, f"queued-{i}", queued, 0.0)
    s = _decide_pd(p, "tell me " * 400)
    assert s.decision is not None and bool(s.decision.prefill) == prefill_named
    assert s.decision.pd.reason == ("split" if prefill_named else "faster-whole")
