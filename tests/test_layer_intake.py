"""The request layer (meshd/intake.py) alone: a fake admission gate and a fake attempts
layer stand for the layers after it and record what they are handed. Malformed bodies,
unknown models, limits and untrusted routing headers are refused or stripped here; what
goes on is a RequestContext with the upstream's headers."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from harness import sidecar_config
from layer_fakes import FakeRequest, Layers, build_layers

from filters.request import RequestError, parse_inference_request
from meshd.context import RequestContext
from meshd.http_message import BodyError, Reply, error_reply
from meshd.intake import Intake

URLS = ["http://e1.test:8001"]
DOC = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
BODY = json.dumps(DOC).encode()
TRUSTED = "127.0.0.1"  # trust.routing_header_sources defaults to loopback
UNTRUSTED = "10.9.8.7"


class FakeAttempts:
    """The attempts layer: records each request it is handed; holds it while `hold` is
    unset."""

    def __init__(self) -> None:
        self.seen: list[RequestContext] = []
        self.hold: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def run(self, req: Any, ctx: RequestContext) -> Reply | None:
        self.seen.append(ctx)
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        return Reply(200, [], b"tried")


class FakeGate:
    """The admission layer: admits (or answers with `refusal`), and records releases."""

    def __init__(self, refusal: Reply | None = None) -> None:
        self.refusal = refusal
        self.admitted: list[RequestContext] = []
        self.released: list[RequestContext] = []

    async def admit(self, ctx: RequestContext, guard: Any) -> Reply | None:
        self.admitted.append(ctx)
        return self.refusal

    def release(self, ctx: RequestContext) -> None:
        self.released.append(ctx)


class RequestLayer:
    """The request layer of a sidecar on `sections`, its neighbours fakes. `intercepted`:
    the pool a transparent connection was headed for (None: the explicit listener)."""

    def __init__(
        self, gate: FakeGate | None = None, intercepted: str | None = None, **sections: Any
    ) -> None:
        self.layers: Layers = build_layers(sidecar_config(URLS, **sections))
        self.attempts = FakeAttempts()
        self.gate = gate or FakeGate()
        self.intake = Intake(
            self.layers.plane,
            self.layers.acct,
            self.gate,  # type: ignore[arg-type]
            self.attempts,  # type: ignore[arg-type]
            precise={},
            chars_per_token=None,
            intercepted_pool=lambda req: intercepted,
        )

    async def post(self, body: bytes = BODY, **kw: Any) -> Reply | None:
        return await self.intake.inference(FakeRequest(body=body, **kw))


def error_of(reply: Reply | None) -> dict[str, Any]:
    assert reply is not None
    err: dict[str, Any] = json.loads(reply.body)["error"]
    return err


@pytest.mark.parametrize(
    "body",
    [b"{not json", b'{"messages": []}', b'{"model": "tiny", "messages": "hi"}', b"[]"],
    ids=["syntax", "no_model", "messages_not_a_list", "not_an_object"],
)
async def test_a_malformed_body_is_400_with_the_parsers_message(body: bytes) -> None:
    with pytest.raises(RequestError) as parsed:
        parse_inference_request("chat", body)
    t = RequestLayer()

    reply = await t.post(body)

    assert reply is not None and reply.status == 400
    err = error_of(reply)
    assert err["message"] == parsed.value.message and err["code"] == parsed.value.code
    assert not t.attempts.seen and not t.gate.admitted


async def test_a_model_no_pool_serves_is_404_model_not_found() -> None:
    t = RequestLayer(pools=[{"name": "default", "models": ["tiny"], "endpoints": URLS}])
    reply = await t.post(json.dumps({**DOC, "model": "huge"}).encode())
    assert reply is not None and reply.status == 404
    err = error_of(reply)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "huge" in err["message"]
    assert not t.attempts.seen


ROUTING = [("x-meshd-tenant", "acme"), ("x-meshd-priority", "9"), ("X-Meshd-Task-Id", "t1")]


async def test_untrusted_routing_headers_are_stripped_before_attempts_see_them() -> None:
    t = RequestLayer()

    reply = await t.post(headers=[*ROUTING, ("x-app", "1")], remote=UNTRUSTED)

    assert reply is not None and reply.status == 200
    (ctx,) = t.attempts.seen
    assert not ctx.trusted
    assert ctx.routing is not None and ctx.routing.tenant is None and ctx.routing.priority is None
    assert not [n for n, _ in ctx.upstream_headers if n.lower().startswith("x-meshd-")]
    assert ("x-app", "1") in ctx.upstream_headers
    assert t.layers.metric("meshd_stripped_routing_headers_total") == 3


async def test_trusted_routing_headers_are_parsed() -> None:
    t = RequestLayer()

    await t.post(headers=ROUTING, remote=TRUSTED)

    (ctx,) = t.attempts.seen
    assert ctx.trusted and ctx.routing is not None
    assert (ctx.routing.tenant, ctx.routing.priority, ctx.routing.task_id) == ("acme", 9, "t1")
    assert ctx.pick is not None and ctx.pick.tenant == "acme" and ctx.pick.priority == 9
    assert t.gate.admitted == [ctx] and t.gate.released == [ctx]


async def test_a_bad_trusted_routing_header_is_400() -> None:
    t = RequestLayer()
    reply = await t.post(headers=[("x-meshd-priority", "urgent!")], remote=TRUSTED)
    assert reply is not None and reply.status == 400
    err = error_of(reply)
    assert err["code"] == "bad_routing_header" and "x-meshd-priority" in err["message"]
    assert not t.attempts.seen


async def test_streams_past_the_limit_are_503_until_one_ends() -> None:
    t = RequestLayer(limits={"max_concurrent_streams": 1})
    t.attempts.hold = asyncio.Event()
    first = asyncio.create_task(t.post())
    await t.attempts.entered.wait()

    reply = await asyncio.wait_for(t.post(), 1)

    assert reply is not None and reply.status == 503
    assert error_of(reply)["code"] == "overloaded"
    assert ("Retry-After", "1") in reply.headers
    t.attempts.hold.set()
    assert (await first) is not None
    assert t.intake.active == 0
    again = await asyncio.wait_for(t.post(), 1)
    assert again is not None and again.status == 200


async def test_a_body_over_the_limit_is_413_from_the_request() -> None:
    too_large = BodyError(413, "body_too_large", "request body exceeds limits.max_body_bytes")
    t = RequestLayer()

    reply = await t.post(body_error=too_large)

    assert reply is too_large.reply and reply.status == 413 and reply.close
    assert not t.attempts.seen
    assert t.intake.active == 0
    assert t.layers.metric("meshd_rejected_requests_total", reason="body_too_large") == 1


async def test_admissions_refusal_is_the_answer_and_nothing_is_tried() -> None:
    refusal = error_reply(429, "queue full", "overloaded", retry_after_s=2)
    t = RequestLayer(FakeGate(refusal))
    reply = await t.post()
    assert reply is refusal
    assert len(t.gate.admitted) == 1 and not t.attempts.seen


async def test_the_admission_slot_is_released_when_the_attempts_end_badly() -> None:
    t = RequestLayer()

    async def boom(req: Any, ctx: RequestContext) -> None:
        raise RuntimeError("an attempts bug")

    t.attempts.run = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await t.post()
    assert len(t.gate.released) == 1
    assert t.intake.active == 0


HOP_BY_HOP = [
    ("Connection", "keep-alive, X-Private"),
    ("Keep-Alive", "timeout=5"),
    ("X-Private", "secret"),
    ("Proxy-Authorization", "Basic Zm9vOmJhcg=="),
    ("TE", "trailers"),
    ("Transfer-Encoding", "chunked"),
    ("Upgrade", "h2c"),
    ("Host", "api.example"),
    ("Content-Length", "99"),
    ("Expect", "100-continue"),
]


async def test_upstream_headers_drop_hop_by_hop_and_get_a_request_id_and_via() -> None:
    t = RequestLayer()

    await t.post(headers=[*HOP_BY_HOP, ("Authorization", "Bearer k"), ("X-App", "a")])

    (ctx,) = t.attempts.seen
    sent = ctx.upstream_headers
    names = [n.lower() for n, _ in sent]
    for name, _ in HOP_BY_HOP:
        assert name.lower() not in names, name
    assert ("Authorization", "Bearer k") in sent and ("X-App", "a") in sent
    assert names.count("x-request-id") == 1 and names.count("via") == 1
    rid = dict((n.lower(), v) for n, v in sent)["x-request-id"]
    assert re.fullmatch("[0-9a-f]{32}", rid) and ctx.request_id == rid
    assert ("via", "1.1 meshd") in sent


async def test_fields_a_connection_field_names_are_dropped_wherever_they_come() -> None:
    t = RequestLayer()
    await t.post(
        headers=[
            ("X-Before", "1"),
            ("Via", "1.0 corp"),
            ("X-Keep", "2"),
            ("Connection", "x-before, VIA"),
            ("connection", "x-after"),
            ("X-After", "3"),
        ]
    )
    (ctx,) = t.attempts.seen
    names = [n for n, _ in ctx.upstream_headers]
    assert names == ["X-Keep", "x-request-id", "via"]
    # A Via the client's Connection names is its hop's: meshd's own starts a new list.
    assert ctx.upstream_headers[-1] == ("via", "1.1 meshd")


async def test_the_active_requests_gauge_counts_what_is_being_served() -> None:
    t = RequestLayer()
    registry = t.layers.plane.metrics.registry
    t.attempts.hold = asyncio.Event()
    first = asyncio.create_task(t.post())
    await t.attempts.entered.wait()
    assert registry.get_sample_value("meshd_active_requests") == 1
    t.attempts.hold.set()
    await first
    assert registry.get_sample_value("meshd_active_requests") == 0


async def test_meshd_appends_itself_to_the_via_the_request_came_with() -> None:
    t = RequestLayer()
    await t.post(headers=[("Via", "1.0 corp-proxy")])
    (ctx,) = t.attempts.seen
    assert [v for n, v in ctx.upstream_headers if n.lower() == "via"] == [
        "1.0 corp-proxy, 1.1 meshd"
    ]


async def test_the_clients_request_id_is_kept() -> None:
    t = RequestLayer()
    await t.post(headers=[("X-Request-Id", "client-7")])
    (ctx,) = t.attempts.seen
    assert ctx.request_id == "client-7"
    assert [v for n, v in ctx.upstream_headers if n.lower() == "x-request-id"] == ["client-7"]


async def test_two_requests_get_different_request_ids() -> None:
    t = RequestLayer()
    await t.post()
    await t.post()
    assert len({ctx.request_id for ctx in t.attempts.seen}) == 2


async def test_other_paths_go_to_the_first_pool_without_admission() -> None:
    t = RequestLayer(
        pools=[{"name": "first", "endpoints": URLS}, {"name": "second", "endpoints": URLS}]
    )
    req = FakeRequest(path="/tokenize", body=b'{"prompt": "hi"}', headers=[("X-App", "a")])

    reply = await t.intake.passthrough(req)

    assert reply is not None and reply.status == 200
    (ctx,) = t.attempts.seen
    assert ctx.pool == "first" and ctx.kind == "other" and ctx.inference is None
    assert ctx.body == req.body and ("X-App", "a") in ctx.upstream_headers
    assert not t.gate.admitted


async def test_untrusted_routing_headers_on_other_paths_are_stripped() -> None:
    t = RequestLayer()
    req = FakeRequest(path="/tokenize", body=b"{}", headers=ROUTING, remote=UNTRUSTED)
    await t.intake.passthrough(req)
    (ctx,) = t.attempts.seen
    assert not [n for n, _ in ctx.upstream_headers if n.lower().startswith("x-meshd-")]


async def test_untrusted_routing_headers_stripped_on_other_paths_are_counted() -> None:
    t = RequestLayer()
    req = FakeRequest(path="/tokenize", body=b"{}", headers=ROUTING, remote=UNTRUSTED)
    await t.intake.passthrough(req)
    assert t.layers.metric("meshd_stripped_routing_headers_total") == 3


TWO_POOLS = [
    {"name": "default", "models": ["tiny"], "endpoints": URLS},
    {"name": "other", "models": ["big"], "endpoints": URLS},
]


async def test_an_intercepted_request_goes_to_the_pool_it_was_headed_for() -> None:
    t = RequestLayer(intercepted="other", pools=TWO_POOLS)
    reply = await t.post()  # model "tiny": pool "default" would serve it
    assert reply is not None and reply.status == 200
    assert [ctx.pool for ctx in t.attempts.seen] == ["other"]


async def test_an_intercepted_request_meshd_already_relayed_is_a_loop() -> None:
    t = RequestLayer(intercepted="other", pools=TWO_POOLS)
    reply = await t.post(headers=[("Via", "1.0 corp, 1.1 meshd")])
    assert reply is not None and reply.status == 508
    assert error_of(reply)["code"] == "loop_detected"
    assert not t.attempts.seen
