# ruff: noqa: F811  (the `engines` and `pd_rig` fixtures, imported, are parameters)
"""`x-meshd-pd` (filters/disagg.py PD_HEADER, issue #25): the decode endpoint's meshd says
in its answer whether it split the request or served it whole (and why), for a trusted
peer only; a relaying meshd drops another's for an untrusted client; `meshd picker`
reads it in its response-headers phase (counted, on the decision's span, the prefill
engine's charge ended as served or not) and removes it from the client's answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from harness import envoy_only, sidecar_config
from test_extproc_pd import (
    PDRig,
    _decide_pd,
    _pd_picker,
    addr,
    pd_rig,  # noqa: F401  (the fixture)
)
from test_sidecar_disagg import (
    LONG,
    PDEngine,
    ask,
    dead_url,
    engines,  # noqa: F401  (the fixture)
    pd_config,
)

from filters.disagg import MAX_PD_HEADER_CHARS, PD_HEADER, PdServed, parse_pd_header
from filters.pool_router import PickerRouter
from meshd.extproc_messages import DESTINATION_HEADER
from meshd.sidecar import Sidecar

UNTRUSTED = {"routing_header_sources": ["10.0.0.0/8"]}


def test_the_header_says_split_and_where_or_whole_and_why() -> None:
    split = PdServed(True, "split", "10.0.0.1:8000")
    assert split.header() == "split; prefill=10.0.0.1:8000" and split.record == "split"
    assert parse_pd_header(split.header()) == split
    whole = PdServed(False, "prefill-failed")
    assert whole.header() == "whole; reason=prefill-failed"
    assert whole.record == "whole:prefill-failed" and parse_pd_header(whole.header()) == whole
    # Case and spaces are loose, unknown parameters ignored, the first of a repeat kept.
    loose = parse_pd_header(" Split ;x=1; prefill = a:1 ;prefill=b:2")
    assert loose == PdServed(True, "split", "a:1")
    assert parse_pd_header("whole") == PdServed(False, "unknown")
    assert parse_pd_header("split") == PdServed(True, "split", None)
    for bad in ("", "halved; reason=x", "reason=x", "whole; reason=" + "x" * MAX_PD_HEADER_CHARS):
        assert parse_pd_header(bad) is None


# -- the decode-side sidecar sets it (meshd/relay.py) -----------------------------------------


async def _post(s: Sidecar, body: dict[str, Any], **headers: str) -> tuple[int, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"http://{s.addresses['outbound']}/v1/chat/completions", json=body, headers=headers
        ) as resp,
    ):
        await resp.read()
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}


async def test_the_decode_sidecar_says_split_on_which_engine_or_whole_and_why(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    p, d = await engines("p0"), await engines("d0")
    s = await sidecar(pd_config([dead_url(), p.url], [d.url]))
    status, headers = await _post(s, ask(stream=True))  # the first prefill engine is down
    assert status == 200 and headers[PD_HEADER] == f"split; prefill={addr(p.url)}"
    status, headers = await _post(s, ask("hi"))
    assert status == 200 and headers[PD_HEADER] == "whole; reason=short-prefill"
    # The picker named the prefill engine: split there; named none: whole, "picker".
    named = {DESTINATION_HEADER: addr(d.url), "x-prefiller-host-port": addr(p.url)}
    status, headers = await _post(s, ask("hi"), **named)
    assert status == 200 and headers[PD_HEADER] == f"split; prefill={addr(p.url)}"
    status, headers = await _post(s, ask(), **{DESTINATION_HEADER: addr(d.url)})
    assert status == 200 and headers[PD_HEADER] == "whole; reason=picker"
    # Every prefill engine down: whole after all.
    alone = await sidecar(pd_config([dead_url()], [d.url]))
    status, headers = await _post(alone, ask())
    assert status == 200 and headers[PD_HEADER] == "whole; reason=prefill-failed"
    # The decode step lost its KV and was retried whole.
    p.lose_kv = True
    status, headers = await _post(s, ask("lost " + LONG))
    assert status == 200 and headers[PD_HEADER] == "whole; reason=kv-fetch-failed"
    assert [("kv_transfer_params" in (r.body or {})) for r in d.requests[-2:]] == [True, False]


async def test_an_untrusted_client_is_not_told_and_a_relay_passes_it_to_trusted_ones_only(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    p, d = await engines("p0"), await engines("d0")
    base = pd_config([p.url], [d.url])
    pools = [x.model_dump(exclude_none=True) for x in base.pools]
    untrusted = await sidecar(sidecar_config([d.url], pools=pools, trust=UNTRUSTED))
    status, headers = await _post(untrusted, ask())
    assert status == 200 and len(p.requests) == 1  # split all the same
    assert PD_HEADER not in headers and "x-meshd-endpoint" not in headers
    # A meshd in front of the decode-side one (which trusts it: loopback) relays its
    # header to a trusted client, and drops it for an untrusted one.
    decode_side = await sidecar(base)
    front = f"http://{decode_side.addresses['outbound']}"
    trusting = await sidecar(sidecar_config([front]))
    status, headers = await _post(trusting, ask())
    assert status == 200 and headers[PD_HEADER] == f"split; prefill={addr(p.url)}"
    wary = await sidecar(sidecar_config([front], trust=UNTRUSTED))
    # Another prompt: the same one again would be served whole where its KV now is.
    status, headers = await _post(wary, ask("again " + LONG))
    assert status == 200 and len(p.requests) == 3 and PD_HEADER not in headers


# -- the picker reads it (meshd/extproc_picker.py) --------------------------------------------


def _response_headers(status: int, pd: str | None) -> pb.ProcessingRequest:
    fields = [base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())]
    if pd is not None:
        fields.append(base_pb2.HeaderValue(key=PD_HEADER, raw_value=pd.encode()))
    hm = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=fields), end_of_stream=False)
    return pb.ProcessingRequest(response_headers=hm)


@pytest.mark.parametrize(
    ("said", "served_ok", "record"),
    [
        ("split; prefill={named}", True, "split"),
        ("split", True, "split"),
        ("whole; reason=prefill-failed", False, "whole:prefill-failed"),
        ("split; prefill=10.9.9.9:1", False, "split"),  # prefilled elsewhere
        (None, True, None),  # a proxy that says nothing (llm-d's): as before
    ],
)
def test_the_picker_records_what_the_decode_side_did(
    said: str | None, served_ok: bool, record: str | None
) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from meshd.telemetry import setup_tracing

    exporter = InMemorySpanExporter()
    provider = setup_tracing("meshd-picker", None, exporter=exporter)
    p = _pd_picker(provider.get_tracer("test"))
    s = _decide_pd(p, "tell me " * 400)
    assert s.decision is not None and s.prefill is not None
    named = s.prefill
    state = p.pd.router._by_url[named.url]
    assert state.outstanding == 1 and state.residence_s is None
    if said is not None:
        said = said.format(named=addr(named.url))
    out = p._on_response_headers(s, _response_headers(200, said))
    # The prefill engine's charge ended; its residence is a sample only if it served.
    assert state.outstanding == 0 and (state.residence_s is not None) is served_ok
    assert p.pd_served == ({record: 1} if record else {})
    # The client does not see where its request went inside the mesh.
    removed = list(out.response_headers.response.header_mutation.remove_headers)
    assert removed == ([PD_HEADER] if said is not None else [])
    p._close(s)
    provider.force_flush()
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert attrs["meshd.pd"] == "split"  # the decision, beside what was done
    assert attrs.get("meshd.pd.served") == record


def test_the_picker_keeps_the_header_for_a_trusted_client_and_bounds_its_counts() -> None:
    from meshd.extproc_picker import MAX_PD_OUTCOMES, EndpointPicker, PickerSettings

    p = _pd_picker()
    trusting = EndpointPicker(
        PickerSettings(p.settings.endpoints, trust_routing_headers=True, pd=p.settings.pd)
    )
    s = _decide_pd(trusting, "hi")
    out = trusting._on_response_headers(s, _response_headers(200, "whole; reason=picker"))
    assert not out.response_headers.HasField("response")
    assert trusting.pd_served == {"whole:picker": 1}
    for i in range(MAX_PD_OUTCOMES + 5):
        s = _decide_pd(trusting, "hi")
        trusting._on_response_headers(s, _response_headers(200, f"whole; reason=r{i}"))
    assert len(trusting.pd_served) == MAX_PD_OUTCOMES + 1
    assert trusting.pd_served["whole:other"] == 6


@envoy_only
async def test_behind_envoy_the_picker_learns_what_each_decode_sidecar_did(
    pd_rig: Callable[[], Awaitable[PDRig]],
) -> None:
    r = await pd_rig()
    status, _ = await r.chat(ask("0 " + LONG))
    assert status == 200 and r.decisions[-1].prefill
    status, _ = await r.chat(ask("hi"))
    assert status == 200 and not r.decisions[-1].prefill
    picker = r.picker.picker
    assert picker.pd_served == {"split": 1, "whole:picker": 1}
    # Every prefill engine gone: the picker still names one, the decode side serves whole.
    for e in r.prefill:
        await e.stop()
    host, port = r.envoy.listener
    async with r.session.post(
        f"http://{host}:{port}/v1/chat/completions", json=ask("1 " + LONG)
    ) as resp:
        await resp.read()
        assert resp.status == 200 and PD_HEADER not in resp.headers
    assert r.decisions[-1].prefill and picker.pd_served["whole:prefill-failed"] == 1
    assert picker.pd is not None
    (named,) = r.decisions[-1].prefill
    router = picker.pd.router
    assert isinstance(router, PickerRouter)
    assert router._by_url[named.url].outstanding == 0
