"""Prefill/decode disaggregation, the choices (issue #25), sans-I/O: the decode leg's order
(Picker.order_decode: KV headroom, then the stream's predicted decode time, never the
prefix), the prefill pool's order that records nothing until a step starts (pick's
`record`, dispatch's `recorded`), the decider's transfer rule (filters/disagg.py), the KV
bytes a token moves (the GPU profile's), and the bootstrap ports learnt from SGLang's
server info."""

from __future__ import annotations

import dataclasses

import pytest

from filters.blockhash import block_hashes
from filters.disagg import (
    BootstrapPorts,
    Split,
    bootstrap_port_of,
    decide_split,
    prefer_whole,
    transfer_seconds,
)
from filters.gpu import GPUS, GpuTable
from filters.picker import PickRequest
from filters.pool_router import EndpointSpec, PickerRouter, make_router

URLS = ["http://e0:1", "http://e1:1"]
SYSTEM = "You are a careful assistant who reads the whole question. " * 120


def _req(prompt: str, *, prompt_tokens: int | None = None, max_tokens: int = 256) -> PickRequest:
    return PickRequest(
        model="m",
        block_hashes=block_hashes(prompt, "m"),
        prompt_tokens=prompt_tokens if prompt_tokens is not None else len(prompt) // 4,
        max_tokens=max_tokens,
        context_key=None,
    )


def _router(*gpus: str, kv: list[int | None] | None = None) -> PickerRouter:
    kv = kv or [None] * len(gpus)
    specs = [
        EndpointSpec(f"http://e{i}:1", gpu=g, kv_capacity_tokens=k)
        for i, (g, k) in enumerate(zip(gpus, kv, strict=True))
    ]
    router = make_router("meshd", specs)
    assert isinstance(router, PickerRouter)
    return router


def _load(router: PickerRouter, url: str, n: int, *, prompt_tokens: int, now: float) -> None:
    """`n` streams decoding at `url` (started, their first token out)."""
    for i in range(n):
        rid = f"{url}-{i}"
        req = _req(f"busy {url} {i}", prompt_tokens=prompt_tokens)
        route = next(r for r in router.order(req, now) if r.url == url)
        router.started(route, rid, req, now)
        router.first_token(route, rid, now)


# ---- the decode leg's order ---------------------------------------------------------------


def test_the_decode_leg_goes_where_its_itl_is_least_not_where_the_prefix_is() -> None:
    router = _router("H100", "H100")
    req = _req(SYSTEM + "question")
    first = router.order(req, 0.0)[0]
    router.started(first, "a", req, 0.0)
    router.finished(first, "a", req, 0.5, ok=True)
    holder = first.url
    _load(router, holder, 3, prompt_tokens=12_000, now=1.0)
    follow = _req(SYSTEM + "question, and another")
    # The picker keeps the follow-up where its prefix is (3 streams: far under the bound)...
    assert router.order(follow, 1.0, record=False)[0].url == holder
    # ...the decode leg, whose KV comes by transfer, goes to the idle engine.
    (best, other) = router.order_decode(follow, 1.0)
    assert best.url != holder and best.reason == "decode" and other.url == holder
    assert best.choice is not None and other.choice is not None
    # The ITL it predicts with this stream added is what orders them.
    assert best.choice.step_s < other.choice.step_s


def test_the_decode_leg_prefers_a_faster_gpu_at_equal_load() -> None:
    router = _router("H100", "H200")
    (best, _) = router.order_decode(_req("x" * 4000), 0.0)
    assert best.url == "http://e1:1"  # the H200's decode step is 26% shorter


def test_kv_headroom_comes_first() -> None:
    # e0 is idle but cannot hold the stream (prompt + output past its free KV); e1 can,
    # with streams decoding there: e1 first, e0 after it as short of KV.
    router = _router("H100", "H100", kv=[10_000, None])
    _load(router, "http://e1:1", 4, prompt_tokens=8_000, now=0.0)
    req = _req("y" * 400, prompt_tokens=8_000, max_tokens=4_000)
    (best, short) = router.order_decode(req, 0.0)
    assert (best.url, best.reason) == ("http://e1:1", "decode")
    assert (short.url, short.reason) == ("http://e0:1", "decode-kv-short")
    # With room on both, the idle one is first again.
    small = _req("y" * 400, prompt_tokens=1_000, max_tokens=200)
    assert router.order_decode(small, 0.0)[0].url == "http://e0:1"


def test_a_decode_choice_predicts_the_lead_and_counts_no_prefill_there() -> None:
    router = _router("H100", "H100")
    req = _req(SYSTEM, prompt_tokens=3_000)
    (best, _) = router.order_decode(req, 0.0, lead_s=0.25)
    assert best.choice is not None and best.predicted_ttft_s is not None
    assert 0.25 < best.predicted_ttft_s < 0.3  # the lead, then one step at an idle engine
    assert best.cached_tokens == 2_999 and best.choice.nominal_s == 0.0
    index = router.picker.index
    assert all(index.used_blocks(s.name) == 0 for s in router.states)  # nothing recorded
    router.started(best, "r", req, 0.0)
    state = next(s for s in router.states if s.url == best.url)
    assert state.pending_prefill_tokens == 1  # its prompt arrives as KV
    # The engine that took the stream holds its KV once it lands: the prompt is noted there.
    held = {s.url: index.used_blocks(s.name) for s in router.states}
    assert held[best.url] > 0 and sum(held.values()) == held[best.url]


def test_round_robin_takes_its_turn_once_per_leg() -> None:
    router = make_router("round-robin", [EndpointSpec(u) for u in URLS])
    req = _req("z" * 100)
    firsts = [router.order_decode(req, 0.0)[0].url for _ in range(4)]
    assert firsts == [URLS[0], URLS[1], URLS[0], URLS[1]]


# ---- recording only where a step starts ---------------------------------------------------


def test_an_unrecorded_order_notes_the_prompt_where_the_attempt_starts() -> None:
    router = _router("H100", "H100")
    req = _req(SYSTEM + "cold")
    routes = router.order(req, 0.0, record=False)
    index = router.picker.index
    assert all(index.used_blocks(s.name) == 0 for s in router.states)
    assert router.picker._homes == {}
    assert not routes[0].recorded and routes[0].choice is not None and routes[0].choice.home
    router.started(routes[0], "r", req, 0.0)
    held = {s.url: index.used_blocks(s.name) for s in router.states}
    assert held[routes[0].url] > 0 and sum(held.values()) == held[routes[0].url]
    assert set(router.picker._homes) == {routes[0].url}
    # A recorded order (the default) notes it as it picks, as before.
    again = _req(SYSTEM + "another cold one")
    assert router.order(again, 1.0)[0].recorded


# ---- the decider and the transfer ---------------------------------------------------------


H100_S = 1.0 / GPUS["H100"].prefill_tokens_per_s


@pytest.mark.parametrize(
    ("cached", "link", "split", "reason"),
    [
        (0, 50.0, True, "split"),
        (14_000, 50.0, True, "split"),  # 12.5% uncached: 2,000 tokens cost 72 ms, the KV 42
        (15_000, 50.0, False, "transfer-slower"),  # 6%: 36 ms to compute, 42 to ship
        (15_900, 50.0, False, "short-prefill"),  # under min_prefill_tokens
        (8_000, 5.0, False, "transfer-slower"),  # a slow link: 419 ms of KV for 289 ms
        (0, 5.0, True, "split"),
    ],
)
def test_the_decider_counts_the_transfer(
    cached: int, link: float, split: bool, reason: str
) -> None:
    got = decide_split(
        16_000,
        cached,
        min_prefill_tokens=256,
        kv_bytes_per_token=131_072,
        kv_link_gb_per_s=link,
        recompute_s_per_token=H100_S,
        prefill_ttft_s=0.4,
    )
    assert (got.split, got.reason) == (split, reason)
    assert got.transfer_s == pytest.approx(16_000 * 131_072 / (link * 1e9))
    assert got.prefill_ttft_s == 0.4


@pytest.mark.parametrize(
    ("decode_cached", "split", "reason"),
    [
        (None, True, "split"),  # nothing known at the decode pool: ship the prompt's KV
        (15_900, False, "short-prefill"),  # the decode engine lacks 100 tokens: do it there
        (14_000, True, "split"),  # 2,000 missing there too: the prefill pool computes them
    ],
)
def test_a_prompt_the_decode_engine_holds_is_finished_there(
    decode_cached: int | None, split: bool, reason: str
) -> None:
    # A conversation's next turn: its history is cached on the decode engine that served
    # the last turn, not on any prefill engine (helper's report, issue #25).
    got = decide_split(
        16_000,
        0,
        min_prefill_tokens=256,
        kv_bytes_per_token=131_072,
        kv_link_gb_per_s=50.0,
        recompute_s_per_token=H100_S,
        decode_cached_tokens=decode_cached,
    )
    assert (got.split, got.reason) == (split, reason)
    assert got.uncached_tokens == 16_000


@pytest.mark.parametrize(
    ("whole_ttft", "margin", "split", "reason"),
    [
        (0.5, 0.5, False, "faster-whole"),  # 0.75 s sooner whole: more than the margin
        (0.75, 0.5, True, "split"),  # the edge: 0.5 s sooner is not more than 0.5
        (0.875, 0.5, True, "split"),  # 0.375 s sooner: not worth the decode engine's stall
        (0.0, None, True, "split"),  # the rule is off
        (None, 0.5, True, "split"),  # nothing predicted whole (no engine, or a balancer)
    ],
)
def test_a_queued_prefill_pool_lends_its_overflow_to_the_decode_engines(
    whole_ttft: float | None, margin: float | None, split: bool, reason: str
) -> None:
    # Rule 4: the split's TTFT is both legs' (the prefill's 1 s, its queue included, and
    # the decode leg's 0.25 s: the transfer and the wait there); the request goes whole
    # when its first token on the decode engine it would take whole comes more than the
    # margin sooner.
    planned = Split(True, "split", 16_000, 0.042, 1.0, 131_072, decode_ttft_s=0.25)
    got = prefer_whole(planned, whole_ttft, margin)
    assert (got.split, got.reason) == (split, reason)
    assert got.transfer_s == planned.transfer_s and got.decode_ttft_s == 0.25


def test_rule_4_needs_both_legs_predicted_and_leaves_a_whole_answer_alone() -> None:
    short = Split(False, "short-prefill", 100, 0.001, 0.2, 131_072, decode_ttft_s=0.1)
    assert prefer_whole(short, 0.0, 0.0) is short
    for missing in ({"prefill_ttft_s": None}, {"decode_ttft_s": None}):
        planned = Split(True, "split", 16_000, 0.042, 1.1, 131_072, decode_ttft_s=0.1)
        planned = dataclasses.replace(planned, **missing)  # type: ignore[arg-type]
        assert prefer_whole(planned, 0.0, 0.0) is planned


def test_sglang_splits_whatever_the_transfer_costs() -> None:
    got = decide_split(
        16_000,
        15_999,
        min_prefill_tokens=256,
        kv_bytes_per_token=131_072,
        kv_link_gb_per_s=0.1,
        recompute_s_per_token=H100_S,
        whole_allowed=False,
    )
    assert got.split and got.transfer_s == pytest.approx(transfer_seconds(16_000, 131_072, 0.1))


def test_kv_bytes_per_token_come_from_the_gpu_profile() -> None:
    assert GpuTable().get("H100").kv_bytes_per_token == 131_072  # Llama-3-8B in bf16
    assert GpuTable().get(None).kv_bytes_per_token == 131_072  # the documented default
    fp8 = GpuTable({"H100": {"kv_bytes_per_token": 65_536}})
    assert fp8.get("NVIDIA H100 80GB HBM3").kv_bytes_per_token == 65_536


# ---- SGLang's bootstrap port, from the engine ---------------------------------------------


def test_the_bootstrap_port_is_read_from_server_info() -> None:
    info = {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 9123}
    assert bootstrap_port_of(info) == 9123
    for bad in ({}, [], None, {"disaggregation_bootstrap_port": "9123"},
                {"disaggregation_bootstrap_port": 0}, {"disaggregation_bootstrap_port": True},
                {"disaggregation_bootstrap_port": 70_000}):  # fmt: skip
        assert bootstrap_port_of(bad) is None


def test_a_learnt_port_is_kept_and_a_failed_ask_waits_before_the_next() -> None:
    ports = BootstrapPorts(retry_s=30.0)
    assert ports.get("http://p0:1", 0.0) == (None, True)
    ports.failed("http://p0:1", 0.0)
    assert ports.get("http://p0:1", 29.0) == (None, False)
    assert ports.get("http://p0:1", 30.0) == (None, True)
    ports.learnt("http://p0:1", 9000)
    assert ports.get("http://p0:1", 31.0) == (9000, False)
