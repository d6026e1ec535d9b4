"""The routing and attempts layer (meshd/attempts.py) alone: a fake upstream pool answers
each attempt, a fake relay stands for the layer after it, and the router and guard record
what they are told. A refusal before the first byte moves on within the retry budget;
every attempt is settled once."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from harness import sidecar_config
from layer_fakes import (
    HANG,
    POOL,
    FakePool,
    FakeRequest,
    FakeUpstream,
    Layers,
    assert_settled_once,
    build_layers,
    install_logs,
    request_context,
)

from meshd.context import Attempt, RequestContext
from meshd.http_message import Reply, error_reply
from meshd.upstream import UpstreamClosedError, UpstreamConnectError, UpstreamProtocolError

URLS = ["http://e1.test:8001", "http://e2.test:8002", "http://e3.test:8003"]
NO_BACKOFF = {"retry": {"backoff_base_s": 0, "backoff_max_s": 0}}
DOC = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


class FakeRelay:
    """The relay layer: records what it is asked to relay and answers with its status.
    `hang`: it waits on the engine until cancelled, and then, as the real relay does,
    settles the attempt as the client's leaving."""

    def __init__(self, attempts: Any = None, hang: bool = False) -> None:
        self.asked: list[tuple[Attempt, Any]] = []
        self.attempts = attempts
        self.hang = hang
        self.entered = asyncio.Event()

    async def relay(
        self, req: FakeRequest, ctx: RequestContext, attempt: Attempt, upstream: Any
    ) -> Reply:
        self.asked.append((attempt, upstream))
        self.entered.set()
        if self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                attempt.cancelled = True
                self.attempts.settle(attempt, "client_disconnect")
                raise
        return Reply(upstream.status, [], b"relayed")


def setup(pool: FakePool, **sections: Any) -> tuple[Layers, Any, Any, FakeRelay]:
    sections.setdefault("reliability", NO_BACKOFF)
    layers = build_layers(sidecar_config(URLS, **sections))
    router, guard = install_logs(layers)
    layers.plane.upstream = pool  # type: ignore[assignment]
    relay = layers.attempts.relay = FakeRelay()  # type: ignore[assignment]
    return layers, router, guard, relay


def refused(url: str) -> UpstreamConnectError:
    return UpstreamConnectError(url, "connect failed: ConnectionRefusedError")


def error_of(reply: Reply) -> dict[str, Any]:
    err: dict[str, Any] = json.loads(reply.body)["error"]
    return err


def outcomes(ctx: RequestContext) -> list[str]:
    return [a.outcome for a in ctx.trace.attempts]


@pytest.mark.parametrize(
    "failure",
    [refused, lambda url: UpstreamClosedError(url, "closed before the response head")],
    ids=["connect_error", "closed_before_head"],
)
async def test_no_connection_moves_to_the_next_endpoint(failure: Any) -> None:
    answer = FakeUpstream(200)
    pool = FakePool(failure, answer)
    layers, router, guard, relay = setup(pool)
    ctx = request_context(layers, DOC)

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is not None and reply.status == 200 and reply.body == b"relayed"
    assert len(pool.sent) == 2 and pool.urls[0] != pool.urls[1]
    assert [up for _, up in relay.asked] == [answer]
    assert all(s.body == ctx.body and ("x-request-id", "req-1") in s.headers for s in pool.sent)
    # The failed endpoint is reported as such to the router and the guard, once.
    first_rid = next(rid for rid, url in router.starts.items() if url == pool.urls[0])
    assert (first_rid, "connect_failed", False) in router.ends
    assert [e["local_failure"] for e in guard.ends] == [True, False]
    assert_settled_once(router, guard)
    assert outcomes(ctx) == ["connect_error", "ok"]
    assert layers.metric("meshd_retries_total", pool=POOL, reason="connect_error") == 1


async def test_an_attempt_is_counted_once_its_bytes_leave() -> None:
    """The router and the guard count an attempt in flight when the pool says its bytes
    left (UpstreamPool.request's `sent`), not before (issue #22: their bookkeeping waits
    until after the send); one that fails before (a header with CR/LF) is still counted,
    then settled, once."""
    counted_at_send: list[int] = []

    class Pool(FakePool):
        async def request(self, *args: Any, **kw: Any) -> Any:
            counted_at_send.append(len(router.starts))
            if len(counted_at_send) == 1:  # as the pool's encoding does: before any send
                raise ValueError("CR, LF or space in a header")
            return await super().request(*args, **kw)

    pool = Pool(FakeUpstream(200))
    layers, router, guard, _relay = setup(pool)
    ctx = request_context(layers, DOC)
    with pytest.raises(ValueError):
        await layers.attempts.run(FakeRequest(), ctx)
    assert counted_at_send == [0]
    assert len(router.starts) == len(guard.starts) == 1
    assert_settled_once(router, guard)

    ctx = request_context(layers, DOC)
    reply = await layers.attempts.run(FakeRequest(), ctx)
    assert reply is not None and reply.status == 200
    assert counted_at_send == [0, 1]  # the second attempt: not yet counted as it was sent
    assert len(router.starts) == len(guard.starts) == 2
    assert_settled_once(router, guard)


async def test_503_with_retry_after_is_retried_on_another_endpoint() -> None:
    busy = FakeUpstream(503, [b'{"error":"busy"}'], headers=[("Retry-After", "0")])
    answer = FakeUpstream(200)
    pool = FakePool(busy, answer)
    layers, router, guard, relay = setup(pool)
    ctx = request_context(layers, DOC)

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is not None and reply.status == 200
    assert pool.urls[0] != pool.urls[1]
    assert [up for _, up in relay.asked] == [answer]
    assert busy.closed  # dropped, never relayed
    assert [e["status"] for e in guard.ends] == [503, 200]
    assert [ok for _, _, ok in router.ends] == [False, True]
    assert_settled_once(router, guard)
    assert outcomes(ctx) == ["http_503", "ok"]


async def test_a_refusing_endpoint_is_held_so_the_next_pick_goes_elsewhere() -> None:
    # Issue #21's engine-503 storm: an engine that refuses at once looked idle and stayed
    # the first pick, one wasted attempt per request. The refusal holds it (the picker
    # counts the hold as queue there): the next request goes elsewhere first.
    from filters.endpoint_state import REFUSAL_HOLD_S

    pool = FakePool(FakeUpstream(503), FakeUpstream(200), FakeUpstream(200))
    layers, router, _guard, _relay = setup(pool)
    ctx = request_context(layers, DOC)
    before = time.monotonic()
    reply = await layers.attempts.run(FakeRequest(), ctx)
    assert reply is not None and reply.status == 200
    refusing = pool.urls[0]
    state = router.inner._by_url[refusing]
    assert state.refusals == 1
    assert state.refused_until == pytest.approx(before + REFUSAL_HOLD_S, abs=0.5)
    # The same request again: its first pick is not the refusing endpoint now.
    again = request_context(layers, DOC)
    reply = await layers.attempts.run(FakeRequest(), again)
    assert reply is not None and reply.status == 200
    assert pool.urls[2] != refusing
    # A Retry-After is believed as said.
    state.refused(time.monotonic(), 7.0)
    assert state.refused_until == pytest.approx(time.monotonic() + 7.0, abs=0.5)


async def test_no_retry_when_every_other_endpoint_is_held_by_a_refusal() -> None:
    # An all-engine 503 storm: with the others refusing moments ago, a retry would only
    # add an attempt (issue #21's all-503 scenario went 1.33x during the fault).
    busy = FakeUpstream(503, [b'{"error":"busy"}'])
    pool = FakePool(busy, FakeUpstream(200))
    layers, router, guard, relay = setup(pool)
    now = time.monotonic()
    for url in URLS:
        router.inner._by_url[url].refused(now)
    ctx = request_context(layers, DOC)
    reply = await layers.attempts.run(FakeRequest(), ctx)
    assert reply is not None and reply.status == 503
    assert len(pool.sent) == 1 and [up for _, up in relay.asked] == [busy]  # relayed
    assert_settled_once(router, guard)


async def test_a_retry_after_beyond_the_limit_is_not_waited_for_but_relayed() -> None:
    busy = FakeUpstream(503, headers=[("Retry-After", "3600")])
    pool = FakePool(busy)
    layers, router, guard, relay = setup(pool)
    ctx = request_context(layers, DOC)

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is not None and reply.status == 503
    assert len(pool.sent) == 1 and [up for _, up in relay.asked] == [busy]
    assert_settled_once(router, guard)


async def test_a_500_is_relayed_not_retried() -> None:
    crashed = FakeUpstream(500)
    pool = FakePool(crashed)
    layers, router, guard, relay = setup(pool)
    reply = await layers.attempts.run(FakeRequest(), request_context(layers, DOC))
    assert reply is not None and reply.status == 500
    assert len(pool.sent) == 1 and [up for _, up in relay.asked] == [crashed]
    assert_settled_once(router, guard)


async def test_retry_budget_exhausted_is_502_naming_the_failure() -> None:
    pool = FakePool(refused, FakeUpstream(200))
    layers, router, guard, relay = setup(
        pool, reliability={"retry": {"ratio": 0, "min_retries_per_s": 0, "backoff_base_s": 0}}
    )
    ctx = request_context(layers, DOC)

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is not None and reply.status == 502
    err = error_of(reply)
    assert err["code"] == "upstream_unavailable"
    assert pool.urls[0] in err["message"] and "ConnectionRefusedError" in err["message"]
    assert len(pool.sent) == 1 and not relay.asked
    assert layers.metric("meshd_retry_budget_exhausted_total", pool=POOL) == 1
    assert_settled_once(router, guard)


async def test_every_endpoint_refusing_is_502_naming_each() -> None:
    pool = FakePool(refused, refused, refused)
    layers, router, guard, _relay = setup(pool)
    ctx = request_context(layers, DOC)

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is not None and reply.status == 502
    message = error_of(reply)["message"]
    assert sorted(pool.urls) == URLS  # each endpoint tried once
    assert all(url in message for url in URLS)
    assert outcomes(ctx) == ["connect_error"] * 3
    assert_settled_once(router, guard)


async def test_no_response_head_in_time_is_504() -> None:
    # Every endpoint takes the request and never answers: each try times out (the next
    # endpoint gets it, as after Envoy's per-try timeout), then the client gets the 504.
    pool = FakePool(HANG, HANG, HANG)
    layers, router, guard, _relay = setup(pool, upstream={"first_byte_timeout_s": 0.05})
    ctx = request_context(layers, DOC)

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is not None and reply.status == 504
    err = error_of(reply)
    assert err["code"] == "upstream_timeout" and "first_byte_timeout_s" in err["message"]
    assert [e["local_failure"] for e in guard.ends] == [True] * 3
    assert outcomes(ctx) == ["timeout"] * 3
    assert sorted(pool.urls) == URLS  # each endpoint tried once
    assert_settled_once(router, guard)


async def test_a_504_names_the_limit_that_ran_out() -> None:
    pool = FakePool(HANG)
    layers, _router, _guard, _relay = setup(pool, upstream={"request_timeout_s": 0.05})
    reply = await layers.attempts.run(FakeRequest(), request_context(layers, DOC))
    assert reply is not None and reply.status == 504
    assert "request_timeout_s" in error_of(reply)["message"]


async def test_the_clients_deadline_bounds_the_wait_for_an_answer() -> None:
    # Issue #21's campaign: x-meshd-deadline-ms bounded the pick and the admission queue
    # but not the wait for the engine's answer, so a request queued in a full engine (or a
    # hung one) was held past its deadline with nothing said. Now the client gets the 504
    # at its deadline, naming it, and no retry starts after it.
    pool = FakePool(HANG, HANG, HANG)
    layers, router, guard, _relay = setup(pool)  # first_byte_timeout_s: 120 s by default
    ctx = request_context(layers, DOC, headers=[("x-meshd-deadline-ms", "200")])
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    reply = await layers.attempts.run(FakeRequest(), ctx)
    assert reply is not None and reply.status == 504
    assert "x-meshd-deadline-ms" in error_of(reply)["message"]
    assert 0.15 <= loop.time() - t0 < 1.0
    assert len(pool.sent) == 1
    assert_settled_once(router, guard)


async def test_a_protocol_error_is_502_upstream_error() -> None:
    pool = FakePool(lambda url: UpstreamProtocolError(url, "malformed status line"))
    layers, router, guard, _relay = setup(pool)
    reply = await layers.attempts.run(FakeRequest(), request_context(layers, DOC))
    assert reply is not None and reply.status == 502
    assert error_of(reply)["code"] == "upstream_error"
    assert len(pool.sent) == 1
    assert_settled_once(router, guard)


def fill_endpoints(guard: Any) -> None:
    """One request in flight on every endpoint (limits: one each)."""
    for url in URLS:
        guard.started(url, ("busy", url), 10, time.monotonic())


FULL = {"breaker": {"max_requests_per_endpoint": 1}, **NO_BACKOFF}


async def test_every_endpoint_at_its_limits_without_admission_is_503_overloaded() -> None:
    pool = FakePool()
    layers, router, guard, _relay = setup(
        pool, reliability={**FULL, "admission": {"enabled": False}}
    )
    fill_endpoints(guard)
    ctx = request_context(layers, DOC)

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is not None and reply.status == 503
    assert error_of(reply)["code"] == "overloaded"
    assert reply.headers.count(("Retry-After", "1")) == 1
    assert not pool.sent and not router.starts


class FakeGate:
    """The admission layer, for an admitted request: `requeue` frees an endpoint (a
    request in flight ends) and lets it go, or answers with `refusal`."""

    def __init__(self, guard: Any, refusal: Reply | None = None) -> None:
        self.guard = guard
        self.refusal = refusal
        self.requeued = 0

    async def requeue(self, ctx: RequestContext) -> Reply | None:
        self.requeued += 1
        if self.refusal is None:
            url = URLS[1]
            self.guard.finished(url, ("busy", url), time.monotonic(), status=200)
        return self.refusal

    def apply(self, pool: str, ev: Any) -> None:
        pass


async def test_every_endpoint_at_its_limits_waits_in_admission_then_goes() -> None:
    answer = FakeUpstream(200)
    pool = FakePool(answer)
    layers, _router, guard, _relay = setup(pool, reliability=FULL)
    gate = layers.attempts.gate = FakeGate(guard)  # type: ignore[assignment]
    fill_endpoints(guard)
    ctx = request_context(layers, DOC)
    ctx.item_id = 1  # admitted

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is not None and reply.status == 200
    assert gate.requeued == 1
    assert pool.urls == [URLS[1]]  # the endpoint that freed up


async def test_every_endpoint_at_its_limits_and_admission_refusing_gives_its_refusal() -> None:
    pool = FakePool()
    layers, _router, guard, _relay = setup(pool, reliability=FULL)
    refusal = error_reply(429, "queued too long", "overloaded", retry_after_s=1)
    layers.attempts.gate = FakeGate(guard, refusal)  # type: ignore[assignment]
    fill_endpoints(guard)
    ctx = request_context(layers, DOC)
    ctx.item_id = 1

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is refusal
    assert not pool.sent


async def test_client_leaving_before_the_response_head_settles_as_client_disconnect() -> None:
    pool = FakePool(HANG)
    layers, router, guard, _relay = setup(pool)
    ctx = request_context(layers, DOC)
    task = asyncio.create_task(layers.attempts.run(FakeRequest(), ctx))
    await pool.waiting.wait()

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert outcomes(ctx) == ["client_disconnect"]
    assert [ok for _, _, ok in router.ends] == [False]
    assert [e["cancelled"] for e in guard.ends] == [True]  # no verdict on the endpoint
    assert_settled_once(router, guard)


async def test_client_leaving_during_the_relay_settles_as_client_disconnect() -> None:
    pool = FakePool(FakeUpstream(200))
    layers, router, guard, _ = setup(pool)
    relay = FakeRelay(layers.attempts, hang=True)
    layers.attempts.relay = relay  # type: ignore[assignment]
    ctx = request_context(layers, DOC)
    task = asyncio.create_task(layers.attempts.run(FakeRequest(), ctx))
    await relay.entered.wait()

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert outcomes(ctx) == ["client_disconnect"]
    assert [e["cancelled"] for e in guard.ends] == [True]
    assert_settled_once(router, guard)


LONG_ANSWER = {**DOC, "max_tokens": 4000}


def warm(router: Any, answers: int = 16) -> None:
    """The pool has finished `answers` whole answers (filters/deadline.py predicts an end
    only after FillConfig.min_samples)."""
    ends = router.inner.ends
    for i in range(answers):
        ends.dispatched(("warm", i), 4000)
        ends.finished(("warm", i), True, 4000)


async def test_a_new_request_predicted_to_end_after_its_deadline_is_refused_unsent() -> None:
    # filters/deadline.py: 4,000 tokens to decode cannot end within half a second.
    pool = FakePool(FakeUpstream(200))
    layers, router, _guard, relay = setup(pool)
    warm(router)
    ctx = request_context(layers, LONG_ANSWER, headers=[("x-meshd-deadline-ms", "500")])

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is not None and reply.status == 429
    err = error_of(reply)
    assert err["code"] == "deadline_unmeetable"
    assert "predicted to finish the answer" in err["message"] and POOL in err["message"]
    assert ("retry-after", "1") in [(k.lower(), v) for k, v in reply.headers]
    assert pool.sent == [] and router.starts == {} and relay.asked == []
    assert layers.metric("meshd_admission_rejections_total", pool=POOL, reason="deadline") == 1
    assert ctx.shed  # unmet demand, for the autoscaler


@pytest.mark.parametrize(
    ("why", "deadline_ms", "continues", "sections"),
    [
        ("a step of a task under way keeps its sunk work", "500", True, {}),
        ("switched off", "500", False, {"admission": {"refuse_predicted_late": False}}),
        ("time enough", "600000", False, {}),
        ("before the pool's speeds are learnt", "500", False, {"warm": 15}),
    ],
)
async def test_a_request_predicted_in_time_or_spared_is_tried(
    why: str, deadline_ms: str, continues: bool, sections: dict[str, Any]
) -> None:
    pool = FakePool(FakeUpstream(200))
    reliability = {k: v for k, v in sections.items() if k != "warm"}
    layers, router, guard, _relay = setup(pool, reliability={**NO_BACKOFF, **reliability})
    warm(router, sections.get("warm", 16))
    ctx = request_context(layers, LONG_ANSWER, headers=[("x-meshd-deadline-ms", deadline_ms)])
    ctx.continues_task = continues

    reply = await layers.attempts.run(FakeRequest(), ctx)

    assert reply is not None and reply.status == 200, why
    assert len(pool.sent) == 1
    assert_settled_once(router, guard)
