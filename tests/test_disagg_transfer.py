# ruff: noqa: F811  (the `engines` fixture, imported from test_sidecar_disagg, is a parameter)
"""Prefill/decode disaggregation: the KV transfer is priced on what the decode engine lacks
(issue #25). vLLM's NIXL connector pulls only the blocks a decode engine's prefix cache does
not hold, so where the decode pool's prefix index knows the prompt (an earlier turn decoded
there) the decider, the decode leg's order and its predicted TTFT count only the rest.
And a split request with a fallback pool is moved on by both legs' predicted TTFT and
cost (meshd/fallback.py), not its prefill leg's alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from harness import sidecar_config
from test_disagg_choice import SYSTEM, _req
from test_sidecar_disagg import (
    LONG,
    PDEngine,
    ask,
    engines,  # noqa: F401  (the fixture; tests take it as a parameter)
    pd_config,
    post,
)

from filters.disagg import (
    decide_split,
    missing_tokens,
    price_decode_routes,
    transfer_seconds,
)
from filters.pool_router import EndpointSpec, PickerRouter, cached_tokens, make_router
from meshd.access_log import read_access_log
from meshd.sidecar import Sidecar

B = 131_072  # KV bytes a token (the GPU profile's)


def test_only_the_tokens_the_decode_engine_lacks_cross_the_link() -> None:
    assert missing_tokens(1000, None) == missing_tokens(1000, 0) == 1000
    assert missing_tokens(1000, 600.4) == 400
    assert missing_tokens(1000, 5000) == 1  # the last token's KV always comes
    kw: dict[str, Any] = {"min_prefill_tokens": 0, "kv_bytes_per_token": B, "kv_link_gb_per_s": 5.0}
    cold = decide_split(10_000, 0, **kw)
    warm = decide_split(10_000, 0, decode_cached_tokens=8_000, **kw)
    assert cold.transfer_s == transfer_seconds(10_000, B, 5.0)
    assert warm.transfer_s == transfer_seconds(2_000, B, 5.0)
    assert warm.kv_bytes_per_token == B
    # On a slow link the whole prompt's transfer is slower than recomputing the half the
    # prefill pool lacks; the decode engine holding most of it makes the split worth it.
    r = 36e-6  # an H100's seconds per prefilled token
    assert decide_split(10_000, 5_000, recompute_s_per_token=r, **kw).reason == "transfer-slower"
    assert decide_split(
        10_000, 5_000, recompute_s_per_token=r, decode_cached_tokens=8_000, **kw
    ).split


def _decode_router() -> PickerRouter:
    specs = [EndpointSpec(f"http://e{i}:1", gpu="H100") for i in range(2)]
    router = make_router("meshd", specs)
    assert isinstance(router, PickerRouter)
    return router


def test_the_decode_engine_holding_the_prompt_is_priced_its_own_transfer() -> None:
    router = _decode_router()
    req = _req(SYSTEM + "the first turn", max_tokens=64)
    assert cached_tokens(router, req, 0.0) == {}
    # The first turn's decode leg went to e1 (the later name: not the tie's winner): its
    # dispatch notes the prompt there.
    routes = router.order_decode(req, 0.0, lead_s=0.0)
    assert [r.url for r in routes] == ["http://e0:1", "http://e1:1"]
    router.started(routes[1], 1, req, 0.0)
    router.first_token(routes[1], 1, 0.1)
    router.finished(routes[1], 1, req, 1.0, ok=True)

    follow = _req(SYSTEM + "the first turn, and the next one", max_tokens=64)
    held = cached_tokens(router, follow, 2.0)
    assert set(held) == {"http://e1:1"} and 0.7 * follow.prompt_tokens < held["http://e1:1"]
    full = transfer_seconds(follow.prompt_tokens, B, 5.0)
    routes = router.order_decode(follow, 2.0, lead_s=full)
    assert routes[0].url == "http://e0:1"  # the picker's own order: a tie, by name
    priced = price_decode_routes(
        routes,
        held,
        follow.prompt_tokens,
        kv_bytes_per_token=B,
        kv_link_gb_per_s=5.0,
        transfer_s=full,
    )
    assert [r.url for r in priced] == ["http://e1:1", "http://e0:1"]
    own = transfer_seconds(missing_tokens(follow.prompt_tokens, held["http://e1:1"]), B, 5.0)
    by_url = {r.url: r for r in routes}
    assert priced[0].predicted_ttft_s is not None and priced[1].predicted_ttft_s is not None
    assert by_url["http://e1:1"].predicted_ttft_s is not None
    assert (
        abs(priced[0].predicted_ttft_s - (by_url["http://e1:1"].predicted_ttft_s - full + own))
        < 1e-9
    )
    assert priced[1] == by_url["http://e0:1"]  # holding nothing: the whole prompt, as before
    # Nothing held anywhere: the order and its predictions as given.
    assert price_decode_routes(routes, {}, 5, kv_bytes_per_token=B, kv_link_gb_per_s=5.0,
                               transfer_s=full) == routes  # fmt: skip


async def test_a_next_turn_ships_only_what_its_decode_engine_lacks(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    p, d = await engines("p0"), await engines("d0")
    s = await sidecar(pd_config([p.url], [d.url], tmp_path, min_prefill_tokens=0))
    first, follow = LONG, LONG + "and then some more words " * 40
    for prompt in (first, follow):
        status, _ = await post(s, ask(prompt))
        assert status == 200
    s.accounting.flush()
    await s.observer.aclose()
    records = list(read_access_log(tmp_path / "access.jsonl"))
    assert [r.pd for r in records] == ["split", "split"]
    (t1,) = [a.kv_transfer_s for a in records[0].attempts if a.reason != "prefill"]
    (t2,) = [a.kv_transfer_s for a in records[1].attempts if a.reason != "prefill"]
    assert t1 is not None and t2 is not None
    # The first turn's whole prompt crossed; the next turn's prompt is ~1.6x as long
    # (its whole KV would take ~1.6 t1), but d0 holds most of the first turn's (the
    # index's estimate, ~0.8 of it): only the rest crosses.
    assert t2 < 0.9 * t1


async def test_a_retry_on_another_decode_engine_logs_that_engines_transfer(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    # The next turn's decode engine (it holds the first turn) is gone: the retry on the
    # other one pulls the whole prompt, and its attempt says so (it said the first's).
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    s = await sidecar(pd_config([p.url], [d0.url, d1.url], tmp_path, min_prefill_tokens=0))
    assert (await post(s, ask(LONG)))[0] == 200
    holder = d0 if d0.requests else d1
    other = d1 if holder is d0 else d0
    await holder.stop()
    status, _ = await post(s, ask(LONG + "and then some more words " * 40))
    assert status == 200 and other.requests
    s.accounting.flush()
    await s.observer.aclose()
    records = list(read_access_log(tmp_path / "access.jsonl"))
    legs = [a for a in records[1].attempts if a.reason != "prefill"]
    assert [a.endpoint for a in legs] == [holder.url, other.url]
    assert legs[0].outcome == "connect_error" and legs[1].outcome == "ok"
    t_holder, t_other = legs[0].kv_transfer_s, legs[1].kv_transfer_s
    assert t_holder is not None and t_other is not None
    assert t_holder < 0.9 * t_other  # the holder lacked only the new turn


# -- a split request's fallback decision prices both legs (meshd/fallback.py) -------------------


def test_a_split_request_is_moved_on_by_both_legs_deadline_and_cost() -> None:
    import time

    from filters.disagg import Split
    from filters.picker import PickRequest
    from filters.pool_router import Route
    from meshd.context import RequestContext
    from meshd.fallback import move_before_trying

    ctx = RequestContext("chat", "decode", 0.0, True)
    ctx.pick = PickRequest(model="m", prompt_tokens=400, deadline_s=time.monotonic() + 0.1)
    prefill = Route("http://p:1", "meshd", predicted_ttft_s=0.05)
    split = Split(True, "split", 400, 0.001, 0.05, B, decode_ttft_s=0.02)
    ctx.pd = split
    assert move_before_trying(ctx, prefill) is None  # 70 ms of 100
    ctx.pd = dataclasses.replace(split, decode_ttft_s=0.08)  # 130 ms: the decode leg misses
    moved = move_before_trying(ctx, prefill)
    assert moved is not None and moved[0] == "deadline_unmeetable"
    # Served whole (not split), the decode leg's figures do not apply.
    ctx.pd = dataclasses.replace(split, split=False, decode_ttft_s=0.08)
    assert move_before_trying(ctx, prefill) is None


async def test_a_split_request_over_its_cap_by_its_decode_leg_moves_to_the_fallback(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    p, d, small = await engines("p0"), await engines("d0"), await engines("small")
    pools = [
        {"name": "prefill", "role": "prefill", "endpoints": [p.url]},
        {
            "name": "decode",
            "role": "decode",
            "models": ["tiny"],
            "endpoints": [d.url],
            "disaggregation": {"prefill_pool": "prefill", "min_prefill_tokens": 64},
            "fallbacks": [{"pool": "small", "model": "small-8b"}],
            # Predicted here: the prefill leg (400 tokens, one output token) ~$0.00005,
            # the decode leg ~$0.00023 for 1,000 output tokens, ~$0.000001 for 4.
            "max_cost_usd": 1e-4,
        },
        {"name": "small", "models": ["small-*"], "endpoints": [small.url]},
    ]
    s = await sidecar(sidecar_config([d.url], pools=pools))
    async with aiohttp.ClientSession() as http:
        for max_tokens, moved in ((1000, True), (4, False)):
            body = ask(LONG, max_tokens=max_tokens)
            async with http.post(
                f"http://{s.addresses['outbound']}/v1/chat/completions", json=body
            ) as r:
                assert r.status == 200, await r.read()
                fell = r.headers.get("x-meshd-fallback")
            if moved:
                # Priced on its prefill leg alone it would have stayed (under the cap).
                assert fell == "small; from=decode; reason=over_cost_cap"
                assert p.requests == [] and d.requests == [] and len(small.requests) == 1
            else:
                assert fell is None and len(p.requests) == 1 and len(d.requests) == 1
