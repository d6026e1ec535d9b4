"""The admission layer (meshd/admission_gate.py) alone, around the pool's real PoolGuard
(meshd/pools.py guard_config) on a small config: admit, queue or refuse with 429 and
Retry-After; a release wakes the next in line; a waiter that times out is refused, and
one that goes away gives its slot back."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from harness import sidecar_config
from layer_fakes import POOL, Layers, build_layers, request_context

from meshd.context import RequestContext
from meshd.http_message import Reply

URLS = ["http://e1.test:8001"]
DOC = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


class Gate:
    """The gate with one slot and a queue of `max_queued`."""

    def __init__(self, *, max_in_flight: int = 1, **admission: Any) -> None:
        settings = {"max_in_flight": max_in_flight, "max_queued": 1, "knee_wait_s": None}
        reliability = {"admission": {**settings, **admission}, "throttle": {"enabled": False}}
        self.layers: Layers = build_layers(sidecar_config(URLS, reliability=reliability))
        self.gate = self.layers.gate
        self.guard = self.layers.plane.guards[POOL]

    def ctx(self, **kw: Any) -> RequestContext:
        return request_context(self.layers, DOC, **kw)

    async def admit(self, ctx: RequestContext) -> Reply | None:
        return await self.gate.admit(ctx, self.guard)

    async def queued(self, ctx: RequestContext) -> asyncio.Task[Reply | None]:
        """Offer `ctx`, which must wait: its task, once it waits."""
        before = self.guard.queued
        task = asyncio.create_task(self.admit(ctx))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not task.done() and self.guard.queued == before + 1
        return task


def error_of(reply: Reply | None) -> dict[str, Any]:
    assert reply is not None
    err: dict[str, Any] = json.loads(reply.body)["error"]
    return err


def retry_after(reply: Reply) -> int:
    return int(dict(reply.headers)["Retry-After"])


async def test_admit_queue_refuse_and_a_release_wakes_the_next() -> None:
    g = Gate()
    first, second, third = g.ctx(), g.ctx(), g.ctx()

    assert await g.admit(first) is None  # a free slot
    waiting = await g.queued(second)  # the slot is taken: it waits
    refused = await g.admit(third)  # the queue is full: refused

    assert refused is not None and refused.status == 429
    assert error_of(refused)["code"] == "overloaded"
    assert retry_after(refused) >= 1
    assert third.item_id is None  # nothing to release
    assert g.layers.metric("meshd_admission_rejections_total", pool=POOL, reason="overload") == 1

    g.gate.release(first)
    assert await asyncio.wait_for(waiting, 1) is None
    assert second.item_id is not None and g.guard.in_flight == 1 and g.guard.queued == 0
    g.gate.release(second)
    assert g.guard.in_flight == 0


async def test_a_request_that_waits_past_the_queue_timeout_is_refused() -> None:
    g = Gate(queue_timeout_s=0.05)
    first, second = g.ctx(), g.ctx()
    assert await g.admit(first) is None

    refused = await asyncio.wait_for(g.admit(second), 2)

    assert refused is not None and refused.status == 429
    err = error_of(refused)
    assert err["code"] == "overloaded" and "queue_timeout_s" in err["message"]
    assert second.item_id is None and g.guard.queued == 0
    g.gate.release(first)
    assert g.guard.in_flight == 0  # the refused one never took the slot


async def test_a_request_whose_deadline_passes_in_the_queue_is_refused() -> None:
    g = Gate()
    first = g.ctx()
    late = g.ctx(headers=[("x-meshd-deadline-ms", "50")], trusted=True)
    assert await g.admit(first) is None

    refused = await asyncio.wait_for(g.admit(late), 2)

    assert refused is not None and refused.status == 429
    assert error_of(refused)["code"] == "deadline_unmeetable"
    assert g.guard.queued == 0


async def test_a_waiter_that_goes_away_leaves_the_queue() -> None:
    g = Gate()
    first, second, third = g.ctx(), g.ctx(), g.ctx()
    assert await g.admit(first) is None
    waiting = await g.queued(second)

    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting

    assert g.guard.queued == 0
    g.gate.release(first)
    assert g.guard.in_flight == 0
    assert await g.admit(third) is None  # straight in


async def test_a_waiter_that_goes_away_as_it_is_woken_gives_its_slot_back() -> None:
    g = Gate()
    first, second, third = g.ctx(), g.ctx(), g.ctx()
    assert await g.admit(first) is None
    waiting = await g.queued(second)

    g.gate.release(first)  # the slot goes to `second`...
    waiting.cancel()  # ...whose client leaves before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiting

    assert g.guard.in_flight == 0
    assert await g.admit(third) is None  # the slot was given back, not leaked


async def test_a_requeued_request_goes_again_when_a_slot_frees() -> None:
    g = Gate(max_in_flight=2)
    first, second = g.ctx(), g.ctx()
    assert await g.admit(first) is None and await g.admit(second) is None
    item = first.item_id

    requeued = asyncio.create_task(g.gate.requeue(first))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not requeued.done() and g.guard.queued == 1

    g.gate.release(second)
    assert await asyncio.wait_for(requeued, 1) is None
    assert first.item_id == item and g.guard.in_flight == 1


async def test_the_reapers_tick_dispatches_a_requeued_request() -> None:
    g = Gate()
    first = g.ctx()
    assert await g.admit(first) is None
    requeued = asyncio.create_task(g.gate.requeue(first))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not requeued.done()

    g.gate.tick(time.monotonic() + 5)  # past the requeue's backoff

    assert await asyncio.wait_for(requeued, 1) is None
    assert g.guard.in_flight == 1


@pytest.mark.parametrize("factor", [2.0, None])
def test_the_breakers_token_limit_follows_the_engines_kv_capacity(factor: float | None) -> None:
    # The fixed 262,144 tokens capped an engine of long prompts (~16 requests of 16k) while
    # it held more; where the capacity is known the limit is max_tokens_kv_factor x it.
    endpoints: Any = [{"url": URLS[0], "kv_capacity_tokens": 1_000_000}]
    reliability = {"breaker": {"max_tokens_kv_factor": factor}}
    layers = build_layers(sidecar_config(endpoints, reliability=reliability))
    breaker = layers.plane.guards[POOL].breaker
    assert breaker is not None
    now = time.monotonic()
    # 20 requests of 16k tokens in flight (327,680 tokens, over the fixed limit).
    for i in range(20):
        breaker.start(URLS[0], ("r", i), 16_384, now)
    assert not breaker.admit(URLS[0], 16_384, None, now).ok
    layers.gate.tick(now)
    # The 21st fits under the followed limit (2,000,000), not under the fixed one.
    assert breaker.admit(URLS[0], 16_384, None, now).ok is (factor is not None)


@pytest.mark.parametrize(
    ("headers", "continues"),
    [([], False), ([("x-meshd-task-id", "t1"), ("x-meshd-task-step", "2")], True)],
    ids=["new", "step-2"],
)
async def test_admission_marks_a_step_of_a_task_under_way(
    headers: list[tuple[str, str]], continues: bool
) -> None:
    # The attempts layer spares such a step its predicted-late refusal (Attempts._late).
    g = Gate()
    ctx = g.ctx(headers=headers)
    assert await g.admit(ctx) is None
    assert ctx.continues_task is continues
