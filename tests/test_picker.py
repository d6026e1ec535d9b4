"""Picker: each scorer on a fake clock, the deadline filter, bounded load, cold-prefix
rendezvous hashing, replication, staleness, stickiness, tie-breaks, eligibility
properties, and the cache-aware "death spiral" against a naive baseline."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.endpoint_state import EndpointState, ReportedState
from filters.gpu import GPUS, GpuTable, normalise_gpu_name
from filters.hotpath import block_hashes
from filters.picker import Choice, Picker, PickerConfig, PickRequest
from filters.prefix_index import PrefixIndex
from filters.request import parse_inference_request
from filters.routing_headers import RoutingHeaders
from loadtest.engine.profiles import get_profile

SYSTEM = "You are a meticulous assistant that answers in full sentences. " * 60  # ~3.8 KB


def req(text: str = "", model: str = "m", **kw) -> PickRequest:
    kw.setdefault("max_tokens", 128)
    return PickRequest(model, block_hashes(text, model), prompt_tokens=max(1, len(text) // 4), **kw)


def fleet(*gpus: str, **kw) -> list[EndpointState]:
    return [EndpointState(f"e{i}", url=f"http://e{i}", gpu=g, **kw) for i, g in enumerate(gpus)]


def names(choices: Sequence[Choice]) -> list[str]:
    return [c.endpoint for c in choices]


# -- GPU table ------------------------------------------------------------------------------


@pytest.mark.parametrize("gpu", ["A100", "H100", "H200", "B200"])
def test_gpu_table_agrees_with_the_engine_simulator(gpu):
    ours = GPUS[gpu]
    sim = get_profile(gpu)
    assert ours.prefill_tokens_per_s == pytest.approx(sim.prefill_tokens_per_s, rel=0.01)
    assert ours.decode_step_s_b1 == pytest.approx(sim.decode_step_time(1, 1024), rel=0.01)
    assert ours.decode_step_s_b64 == pytest.approx(sim.decode_step_time(64, 1024), rel=0.01)
    assert ours.kv_tokens == pytest.approx(sim.kv_blocks * sim.block_size, rel=0.01)
    assert ours.price_per_gpu_hour == sim.price_per_gpu_hour
    assert ours.max_num_batched_tokens == sim.max_num_batched_tokens
    assert ours.max_num_seqs == sim.max_num_seqs
    assert ours.kv_read_s_per_token == pytest.approx(sim.kv_read_s_per_token, rel=0.01)
    assert ours.kv_bytes_per_token == sim.kv_bytes_per_token
    # The split step model reproduces the simulator at long context too.
    base, per_seq, kv = ours.decode_step_parts()
    for batch, context in ((1, 1024), (8, 20_000), (64, 4_000)):
        step = base + per_seq * batch + kv * batch * context
        assert step == pytest.approx(sim.decode_step_time(batch, context), rel=0.03)
    # Prefill's attention: the compute of a prompt (or of its tail after a cached prefix)
    # as the simulator's roofline has it, within 1%, from 2k to 50k tokens.
    for uncached, cached in ((2_048, 0), (12_672, 0), (50_000, 0), (300, 12_000)):
        pairs = uncached * cached + uncached * (uncached + 1) / 2
        compute = uncached / sim.prefill_tokens_per_s + pairs * sim.attn_s_per_pair
        ours_s = ours.prefill_work(uncached, cached) / ours.prefill_tokens_per_s
        assert ours_s == pytest.approx(compute, rel=0.01)
    assert ours.prefill_work(50_000) / 50_000 > 1.8  # attention, not a constant factor


def test_gpu_names_and_overrides():
    assert normalise_gpu_name("NVIDIA H100 80GB HBM3") == "H100"
    assert normalise_gpu_name("NVIDIA A100-SXM4-80GB") == "A100"
    assert normalise_gpu_name("GH200 480GB") == "H200"
    assert normalise_gpu_name(None) == "unknown"
    table = GpuTable({"H100": {"price_per_gpu_hour": 2.2}, "L40S": {"prefill_tokens_per_s": 9e3}})
    assert table.get("h100").price_per_gpu_hour == 2.2
    assert table.get("NVIDIA L40S").prefill_tokens_per_s == 9e3
    assert table.get("L40S").price_per_gpu_hour == table.get("unknown").price_per_gpu_hour
    assert table.get("TPU v9").name == "unknown"
    with pytest.raises(ValueError, match="unknown field"):
        GpuTable({"H100": {"colour": 1.0}})
    with pytest.raises(ValueError, match="> 0"):
        GpuTable({"H100": {"price_per_gpu_hour": 0}})


# -- EndpointState ----------------------------------------------------------------------------


def test_endpoint_counters_follow_the_request_lifecycle():
    e = EndpointState("e", gpu="H100")
    e.start("r1", 0.0, prompt_tokens=1000, uncached_tokens=200, max_tokens=50)
    e.start("r2", 0.0, prompt_tokens=500, max_tokens=10)
    assert (e.outstanding, e.waiting, e.pending_prefill_tokens, e.tokens_in_flight) == (
        2,
        2,
        700,
        1560,
    )
    assert e.first_token("r1", 0.1) == pytest.approx(0.1)
    assert e.first_token("r1", 0.2) is None  # once
    assert (e.waiting, e.pending_prefill_tokens, e.running(0.2)) == (1, 500, 1)
    e.finish("r2", 0.3, ok=False)
    e.finish("r1", 2.0)
    e.finish("nope", 2.0)
    assert (e.outstanding, e.waiting, e.pending_prefill_tokens, e.tokens_in_flight) == (0,) * 4
    assert e.residence_s == pytest.approx(2.0)
    with pytest.raises(ValueError):
        e.start("r3", 3.0, prompt_tokens=1)
        e.start("r3", 3.0, prompt_tokens=1)


def test_reports_go_stale_and_merge_with_local_figures():
    e = EndpointState("e", report_ttl_s=5.0)
    e.start("r", 0.0, prompt_tokens=100, max_tokens=100)
    e.report(
        ReportedState(
            epoch=1,
            kv_block_size=16,
            kv_capacity_blocks=1000,
            kv_usage=0.5,
            requests_running=7,
            requests_waiting=3,
            tokens_in_flight=50,
        ),
        1.0,
    )
    assert e.fresh_report(5.9) is not None and e.fresh_report(6.0) is None
    assert e.kv_capacity(2.0) == 16_000 and e.kv_used(2.0) == 8000.0
    assert e.running(2.0) == 7 and e.queued(2.0) == 3 and e.load_requests(2.0) == 10
    assert e.load_tokens(2.0) == 200  # ours is larger
    assert e.running(7.0) == 0 and e.queued(7.0) == 1  # stale: local only
    assert e.silent_for(5.0) == 0.0 and e.silent_for(8.0) == pytest.approx(2.0)


def test_connect_failures_eject_with_backoff():
    e = EndpointState("e")
    for t in (0.0, 1.0):
        e.connect_failure(t)
    assert e.ineligible_reason(1.0) is None
    e.connect_failure(2.0)
    assert e.ineligible_reason(2.0) == "ejected"
    assert e.ineligible_reason(12.0) is None
    e.connect_failure(12.0)  # still failing: the rest doubles
    assert e.ineligible_reason(12.0 + 19.0) == "ejected"


# -- the scorers ------------------------------------------------------------------------------


def test_gpu_generation_speed_and_price_trade_off():
    eps = fleet("A100", "B200")
    p = Picker()
    # A batch job (priority 0) that mostly decodes: on an elastic pool whose operator
    # values its seconds little, where a token is cheapest...
    batch = PickRequest("m", (), prompt_tokens=100, max_tokens=2000, priority=0)
    elastic = Picker(PickerConfig(elastic=True, lambda_usd_per_s=1e-4))
    cheap = elastic.pick(batch, eps, 0.0, record=False)
    assert cheap[0].endpoint == "e0"
    assert cheap[0].predicted_cost_usd < cheap[1].predicted_cost_usd
    # ...on a fixed fleet (its GPUs are paid for anyway) valuing a second of decode like
    # one of TTFT, where its 2,000 tokens end sooner.
    fixed = Picker(PickerConfig(decode_weight=1.0))
    assert fixed.pick(batch, eps, 0.0, record=False)[0].endpoint == "e1"
    # An urgent long prompt goes where prefill is fastest.
    urgent = PickRequest("m", (), prompt_tokens=8000, max_tokens=100, priority=9)
    fast = p.pick(urgent, eps, 0.0, record=False)
    assert fast[0].endpoint == "e1"
    assert fast[0].predicted_ttft_s < fast[1].predicted_ttft_s / 5


def test_predictions_are_seconds_and_dollars():
    (e,) = fleet("H100")
    c = Picker().pick(PickRequest("m", (), prompt_tokens=27_712, max_tokens=0), [e], 0.0)[0]
    h100 = GPUS["H100"]
    # A second of H100 prefill's linear work, attention on top (half of the prompt's
    # 27,712 tokens on average before each: x1.45), plus one decode step for the first token.
    pre = 1.0 + h100.attn_pair_tokens * 27_713 / 2
    assert pre == pytest.approx(1.453, abs=1e-3)
    assert c.predicted_ttft_s == pytest.approx(pre + h100.decode_step_s(1), rel=1e-3)
    assert c.predicted_cost_usd == pytest.approx(pre * h100.price_per_gpu_hour / 3600, rel=1e-3)
    assert c.nominal_s == pytest.approx(c.predicted_ttft_s) and c.fixed_s == 0.0


def test_memory_headroom_kv_wait():
    eps = fleet("H100", "H100")
    for e, usage in zip(eps, (0.999, 0.1), strict=True):
        e.report(ReportedState(kv_block_size=16, kv_capacity_blocks=10_000, kv_usage=usage), 0.0)
    r = PickRequest("m", (), prompt_tokens=2000, max_tokens=500)
    out = Picker(PickerConfig(kv_wait_weight=1.0)).pick(r, eps, 0.0)
    assert out[0].endpoint == "e1"
    full = out[1]
    # 2,500 tokens needed, 160 free of 160,000: wait for that share of a residence time.
    assert full.fixed_s == pytest.approx((2500 - 160) / 160_000 * 10.0, rel=1e-3)
    assert full.predicted_ttft_s > out[0].predicted_ttft_s
    # By default memory is left to the engine's own queue: no wait is priced.
    assert Picker().pick(r, eps, 0.0)[1].fixed_s == 0.0


def test_a_reported_kv_usage_counts_only_what_was_not_ours_then():
    # The report's KV in use includes our requests of that moment: what is not ours then is
    # the other clients', added to ours now, so a scrape that predates our answers' ends
    # does not hold the engine full until the next one.
    (e,) = fleet("H100")
    p = Picker(PickerConfig(kv_wait_weight=1.0))
    for i in range(4):
        e.start(("ours", i), 0.0, prompt_tokens=30_000, max_tokens=0)
        e.first_token(("ours", i), 0.0)
    # 160,000 tokens; 150,000 in use: our 120,000 and 30,000 of another client's.
    e.report(
        ReportedState(kv_block_size=16, kv_capacity_blocks=10_000, kv_usage=150_000 / 160_000),
        1.0,
    )
    assert p._view(e, 1.0).kv_used == pytest.approx(150_000)
    for i in range(4):
        e.finish(("ours", i), 2.0)
    v = p._view(e, 2.0)
    assert v.kv_used == pytest.approx(30_000)  # the other client's, not the stale 150,000
    assert v.free_kv == pytest.approx(130_000)


def test_kv_cache_state_prefers_the_endpoint_with_the_prefix():
    eps = fleet("H100", "H100", "H100")
    p = Picker()
    first = p.pick(req(SYSTEM + "Q1"), eps, 0.0)
    assert first[0].reason == "cold-hash"
    second = p.pick(req(SYSTEM + "Q2, longer"), eps, 1.0)
    assert second[0].endpoint == first[0].endpoint
    assert second[0].reason == "prefix-affinity"
    shared_tokens = (len(SYSTEM.encode()) // 64) * 16
    assert second[0].cached_tokens == int(shared_tokens * p.index.approx_confidence)
    assert second[0].predicted_ttft_s < second[1].predicted_ttft_s
    assert second[1].cached_tokens == 0


def test_warm_and_cold_weights():
    eps = fleet("B200", "A100", "H100")
    eps[0].report(ReportedState(models={"m": False}), 0.0)  # sleeping: weights offloaded
    eps[2].report(ReportedState(models={"other": True}), 0.0)  # does not serve m at all
    p = Picker()
    r = PickRequest("m", (), prompt_tokens=500, max_tokens=50, priority=7)
    out = p.pick(r, eps, 0.0)
    assert names(out) == ["e1", "e0"]  # e2 is ineligible
    assert out[1].fixed_s == pytest.approx(p.config.model_cold_load_s)
    # LoRA: loaded on e1 only; e0 can load any adapter on demand (cold).
    eps = fleet("H100", "H100", "H100")
    eps[0].dynamic_lora = True
    eps[1].report(ReportedState(adapters={"sql": True}), 0.0)
    lora = PickRequest("m", (), prompt_tokens=500, max_tokens=50, adapter="sql")
    out = Picker().pick(lora, eps, 0.0)
    assert names(out) == ["e1", "e0"]
    assert out[1].fixed_s == pytest.approx(PickerConfig().lora_cold_load_s)


def test_tenant_priority_sets_the_value_of_time():
    eps = fleet("A100", "B200")
    # An elastic pool, where the dollars a batch job saves count.
    p = Picker(PickerConfig(tenant_priority={"batch": 0, "vip": 9}, elastic=True))
    r = dict(prompt_tokens=200, max_tokens=150)
    assert p.pick(PickRequest("m", (), tenant="batch", **r), eps, 0.0)[0].endpoint == "e0"
    assert p.pick(PickRequest("m", (), tenant="vip", **r), eps, 0.0)[0].endpoint == "e1"
    # An explicit header priority wins over the tenant default.
    explicit = PickRequest("m", (), tenant="vip", priority=0, **r)
    assert p.pick(explicit, eps, 0.0)[0].endpoint == "e0"


def test_deadline_filter_and_unmeetable_best_effort():
    eps = fleet("H100", "H100", "H100")
    for i in range(40):
        eps[0].start(i, 0.0, prompt_tokens=8000, max_tokens=10)  # ~11.5 s of prefill queued
    eps[1].start("x", 0.0, prompt_tokens=2000, max_tokens=10)  # ~70 ms queued
    p = Picker()
    r = PickRequest("m", (), prompt_tokens=1000, max_tokens=10, deadline_s=0.5)
    out = p.pick(r, eps, 0.0)
    assert "e0" not in names(out) and len(out) == 2
    tight = PickRequest("m", (), prompt_tokens=1000, max_tokens=10, deadline_s=0.001)
    out = p.pick(tight, eps, 0.0)
    assert [c.reason for c in out] == ["deadline-unmeetable"] * 3
    ttfts = [c.predicted_ttft_s for c in out]
    assert ttfts == sorted(ttfts) and out[-1].endpoint == "e0"


def test_workflow_stickiness_and_previous_output():
    eps = fleet("H100", "H100", "H100", "H100")
    p = Picker()
    turn1 = SYSTEM + "User: plan a trip."
    a = p.pick(req(turn1, context_key="task-1", max_tokens=400), eps, 0.0)[0]
    # Next step: history + the answer the engine generated + a new message.
    turn2 = turn1 + " Assistant: " + "x" * 1600 + " User: and the budget?"
    matched_only = p.index.match_detail(req(turn2).block_hashes, 1.0)[a.endpoint][1] * 16
    b = p.pick(req(turn2, context_key="task-1", max_tokens=400), eps, 1.0)
    assert b[0].endpoint == a.endpoint
    assert b[0].reason in ("sticky", "prefix-affinity")
    # The previous output counts as cached there too (half its max_tokens, at the index's
    # confidence in what it routed).
    conf = p.config.approx_confidence
    assert b[0].cached_tokens == int(matched_only + 400 * 0.5 * conf)
    # Equal endpoints, no prefix at all: stickiness is the tie-break.
    eps2 = fleet("H100", "H100", "H100")
    p2 = Picker()
    p2._commit(PickRequest("m", context_key="t"), p2.pick(PickRequest("m"), eps2, 0.0)[1], 0.0)
    again = p2.pick(PickRequest("m", context_key="t"), eps2, 0.0)
    assert again[0].endpoint == "e1" and again[0].reason == "sticky"


def test_task_map_is_bounded():
    eps = fleet("H100", "H100")
    p = Picker(PickerConfig(task_map_size=3))
    for i in range(10):
        p.pick(PickRequest("m", context_key=f"t{i}"), eps, float(i))
    assert list(p._tasks) == ["t7", "t8", "t9"]


def test_calibration_notices_a_degraded_gpu():
    eps = fleet("H100", "H100")
    p = Picker()
    r = PickRequest("m", (), prompt_tokens=4000, max_tokens=10)
    now = 0.0
    for i in range(30):  # e0 is three times slower than its datasheet
        c = next(c for c in p.pick(r, eps, now) if c.endpoint == "e0")
        p.dispatch(c, r, i, now)
        eps[0].first_token(i, now + 3 * c.predicted_ttft_s)
        eps[0].finish(i, now + 3 * c.predicted_ttft_s)
        now += 1.0
    assert eps[0].ttft_ratio > 2.5
    out = p.pick(r, eps, now)
    assert out[0].endpoint == "e1"
    assert out[1].predicted_ttft_s > 2.5 * out[0].predicted_ttft_s


# -- eligibility ------------------------------------------------------------------------------


def test_ineligible_endpoints_are_never_returned():
    eps = fleet(*["H100"] * 7)
    eps[0].set_flags(draining=True)
    eps[1].set_flags(breaker_open=True)
    for t in range(3):
        eps[2].connect_failure(float(t))
    eps[3].report(ReportedState(healthy=False), 0.0)
    eps[4].report(ReportedState(draining=True), 0.0)
    eps[5].models = frozenset({"other"})
    p = Picker(PickerConfig(max_choices=None))
    assert names(p.pick(PickRequest("m"), eps, 3.0)) == ["e6"]
    hooked = Picker(eligible=lambda e, r, now: e.name != "e6")
    assert hooked.pick(PickRequest("m"), eps, 3.0) == []
    # A stale "unhealthy" report no longer excludes; the ejection ends with its rest.
    assert "e3" in names(p.pick(PickRequest("m"), eps, 100.0))
    assert "e2" in names(p.pick(PickRequest("m"), eps, 100.0))


@st.composite
def endpoint_sets(draw):
    n = draw(st.integers(1, 12))
    eps = []
    for i in range(n):
        e = EndpointState(
            f"e{i}",
            gpu=draw(st.sampled_from(["A100", "H100", "H200", "B200", "weird"])),
            models=draw(st.sampled_from([None, frozenset({"m"}), frozenset({"x"})])),
            dynamic_lora=draw(st.booleans()),
        )
        if draw(st.booleans()):
            e.report(
                ReportedState(
                    epoch=draw(st.integers(0, 2)),
                    healthy=draw(st.booleans()),
                    draining=draw(st.booleans()),
                    kv_block_size=16,
                    kv_capacity_blocks=draw(st.integers(0, 5000)),
                    kv_usage=draw(st.floats(0, 1)),
                    requests_running=draw(st.integers(0, 2000)),
                    requests_waiting=draw(st.integers(0, 50)),
                    models=draw(st.sampled_from([{}, {"m": True}, {"m": False}])),
                    adapters=draw(st.sampled_from([{}, {"a": True}, {"a": False}])),
                ),
                draw(st.floats(-30, 0)),
            )
        for j in range(draw(st.integers(0, 5))):
            e.start(j, 0.0, prompt_tokens=draw(st.integers(1, 9000)), max_tokens=100)
        if draw(st.integers(0, 5)) == 0:
            e.set_flags(draining=True)
        if draw(st.integers(0, 5)) == 0:
            e.set_flags(breaker_open=True)
        eps.append(e)
    # The same object twice must still come back at most once.
    if draw(st.booleans()):
        eps.append(eps[0])
    return eps


@settings(max_examples=150, deadline=None)
@given(
    eps=endpoint_sets(),
    prompts=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    adapter=st.sampled_from([None, "a"]),
    deadline=st.sampled_from([None, 0.01, 0.5, 30.0]),
    priority=st.sampled_from([None, 0, 5, 9]),
    max_choices=st.sampled_from([None, 1, 3]),
)
def test_never_returns_an_ineligible_endpoint_and_each_at_most_once(
    eps, prompts, adapter, deadline, priority, max_choices
):
    p = Picker(PickerConfig(max_choices=max_choices))
    now = 1.0

    def eligible(e: EndpointState) -> bool:
        if e.ineligible_reason(now) is not None or e.model_warm("m", now) is None:
            return False
        return adapter is None or e.adapter_warm(adapter, now) is not None

    for k, prompt in enumerate(prompts):
        allowed = {e.name for e in eps if eligible(e)}  # reports go stale as time moves
        text = SYSTEM[: 64 * (prompt + 1) * 8] + str(k)
        r = req(text, adapter=adapter, priority=priority, context_key="t")
        r = PickRequest(
            **{**_fields(r), "deadline_s": None if deadline is None else now + deadline}
        )
        out = p.pick(r, eps, now)
        got = names(out)
        assert set(got) <= allowed
        assert len(got) == len(set(got))
        assert bool(got) == bool(allowed)
        assert [c.rank for c in out] == list(range(len(out)))
        if max_choices is not None:
            assert len(out) <= max_choices
        for c in out:
            assert c.predicted_ttft_s > 0 and c.predicted_cost_usd >= 0
            assert 0 <= c.cached_tokens < r.prompt_tokens or r.prompt_tokens == 1
        now += 0.5


def _fields(r: PickRequest) -> dict[str, object]:
    return {f: getattr(r, f) for f in PickRequest.__dataclass_fields__}


# -- bounded load, cold prefixes, replication ---------------------------------------------------


def test_bounded_load_keeps_the_primary_under_the_cap():
    eps = fleet("H100", "H100", "H100", "H100")
    # J without its decode seconds (the delay added to 30 streams would price e0 out too).
    p = Picker(PickerConfig(decode_weight=0.0))
    hot = req(SYSTEM + "a question")
    p.index.record("e0", hot.block_hashes, 0.0)
    for i in range(30):  # decoding (first token seen), so they do not delay prefill
        eps[0].start(i, 0.0, prompt_tokens=100, max_tokens=100)
        eps[0].first_token(i, 0.0)
    out = p.pick(hot, eps, 0.0)
    # e0 has the cache and the lowest J, but 30 > 1.25 x (30 + 1) / 4: not the primary.
    assert out[0].endpoint != "e0"
    assert {c.endpoint: c.reason for c in out}["e0"] == "over-load-bound"
    loaded = next(c for c in out if c.endpoint == "e0")
    assert loaded.score < out[0].score
    # Below the floor (8 requests per H100) nobody is hot: affinity wins.
    light = fleet("H100", "H100")
    p2 = Picker()
    p2.index.record("e0", hot.block_hashes, 0.0)
    for i in range(5):
        light[0].start(i, 0.0, prompt_tokens=100, max_tokens=100)
        light[0].first_token(i, 0.0)
    assert p2.pick(hot, light, 0.0)[0].endpoint == "e0"


@settings(max_examples=80, deadline=None)
@given(
    loads=st.lists(st.integers(0, 60), min_size=2, max_size=8),
    eps_=st.sampled_from([0.1, 0.25, 1.0]),
)
def test_bounded_load_property(loads, eps_):
    eps = fleet(*["H100"] * len(loads))
    for e, n in zip(eps, loads, strict=True):
        for i in range(n):
            e.start(i, 0.0, prompt_tokens=50, max_tokens=10)
            e.first_token(i, 0.0)
    p = Picker(PickerConfig(epsilon=eps_))
    r = req(SYSTEM)
    for e in eps:  # everyone holds the prefix: affinity alone would not decide
        p.index.record(e.name, r.block_hashes, 0.0)
    primary = p.pick(r, eps, 0.0)[0]
    load = primary.state.outstanding
    cap = (1 + eps_) * (sum(loads) + 1) / len(loads)
    assert load + 1 <= cap or load <= 8


def test_cold_prefix_goes_by_rendezvous_hash_across_independent_pickers():
    eps_a = fleet(*["H100"] * 8)
    eps_b = fleet(*["H100"] * 8)
    pickers = [Picker() for _ in range(3)]
    spread = set()
    for k in range(40):
        r = req(f"Document {k}: " + SYSTEM)
        picks = {
            pk.pick(r, eps_a if i % 2 else eps_b, 0.0)[0].endpoint for i, pk in enumerate(pickers)
        }
        assert len(picks) == 1  # no coordination needed to agree
        spread |= picks
        assert pickers[0].pick(r, eps_a, 0.0, record=False)[0].reason == "prefix-affinity"
    assert len(spread) >= 6  # different prefixes spread out


def test_replication_when_a_group_outgrows_its_holders():
    eps = fleet("H100", "H100", "H100")
    p = Picker(PickerConfig(demand_window_s=1.0))
    reasons = []
    holders = set()
    for k in range(200):
        # Many requests of one prefix group, arriving fast; nothing is ever dispatched,
        # so the local queue model sees no load: only the demand estimate can react.
        out = p.pick(req(SYSTEM + f"q{k}", max_tokens=256), eps, k * 0.005)
        reasons.append(out[0].reason)
        holders.add(out[0].endpoint)
    assert "replicate" in reasons
    assert holders == {"e0", "e1", "e2"}
    assert reasons.index("replicate") > 10  # not before the group is actually hot
    # A cold group does not replicate.
    q = Picker()
    cool = [q.pick(req(SYSTEM + f"q{k}"), eps, k * 10.0)[0].reason for k in range(20)]
    assert "replicate" not in cool


# -- staleness -----------------------------------------------------------------------------------


def test_epoch_change_clears_the_restarted_engine():
    eps = fleet("H100", "H100")
    p = Picker()
    r = req(SYSTEM + "x")
    eps[0].report(ReportedState(epoch="boot-1"), 0.0)
    p.index.record("e0", r.block_hashes, 0.0)
    assert p.pick(r, eps, 1.0, record=False)[0].endpoint == "e0"
    eps[0].report(ReportedState(epoch="boot-2"), 2.0)  # restarted
    out = p.pick(r, eps, 2.0, record=False)
    assert all(c.cached_tokens == 0 for c in out)
    assert out[0].reason == "cold-hash"


def test_silent_engine_is_demoted_then_ignored():
    eps = fleet("H100", "H100")
    eps[0].report_ttl_s = 5.0
    p = Picker(PickerConfig(stale_trust=0.5, silent_drop_s=60.0))
    r = req(SYSTEM + "x")
    eps[0].report(ReportedState(epoch=1), 0.0)
    p.index.record("e0", r.block_hashes, 0.0)
    fresh = p.pick(r, eps, 1.0, record=False)[0].cached_tokens
    assert fresh > 0
    stale = next(c for c in p.pick(r, eps, 10.0, record=False) if c.endpoint == "e0")
    assert stale.cached_tokens == pytest.approx(fresh * 0.5, abs=1)
    gone = next(c for c in p.pick(r, eps, 70.0, record=False) if c.endpoint == "e0")
    assert gone.cached_tokens == 0


def test_cleared_cache_demotion_and_ghost_correction():
    eps = fleet("H100", "H100")
    p = Picker()
    r = req(SYSTEM + "x")
    p.index.record("e0", r.block_hashes, 0.0)
    full = p.pick(r, eps, 0.0, record=False)[0]
    p.index.demote("e0", 0.5)  # e.g. missed KV-event sequence numbers
    half = p.pick(r, eps, 0.0, record=False)[0]
    assert half.cached_tokens == pytest.approx(full.cached_tokens / 2, abs=1)
    # The engine said it had only 32 tokens cached: a ghost. The request has just been
    # prefilled there, so the entry stays (the engine holds the prompt now); what the
    # ghost says is that e0 keeps less than assumed: its index capacity shrinks.
    blocks = p.index.match(r.block_hashes, 0.0)["e0"]
    cap = p.index.capacity("e0")
    p.observe_cached(half, r, 32, 0.0)
    assert p.index.match(r.block_hashes, 0.0) == {"e0": blocks}
    assert p.index.capacity("e0") < cap
    p.index.clear("e0")  # AllBlocksCleared
    assert p.index.match(r.block_hashes, 0.0) == {}


# -- tie-breaks and determinism ------------------------------------------------------------------


def test_tie_breaks_are_deterministic_and_order_independent():
    eps = fleet(*["H100"] * 6)
    p = Picker(PickerConfig(max_choices=None))
    first = names(p.pick(PickRequest("m", prompt_tokens=10), eps, 0.0, record=False))
    assert first == [f"e{i}" for i in range(6)]  # equal J: by name
    shuffled = eps[:]
    random.Random(3).shuffle(shuffled)
    for _ in range(3):
        assert names(p.pick(PickRequest("m", prompt_tokens=10), shuffled, 0.0)) == first
    r = req(SYSTEM + "cold")
    a = Picker().pick(r, eps, 0.0, record=False)
    b = Picker().pick(r, list(reversed(eps)), 0.0, record=False)
    assert names(a) == names(b)


def test_dispatch_accounts_the_request_and_records_fallbacks():
    eps = fleet("H100", "H100")
    p = Picker()
    r = req(SYSTEM + "z", max_tokens=64)
    out = p.pick(r, eps, 0.0)
    fallback = out[1]
    p.dispatch(fallback, r, "rid", 0.0)
    e = fallback.state
    assert (e.outstanding, e.tokens_in_flight) == (1, r.prompt_tokens + 64)
    assert set(p.index.match(r.block_hashes, 0.0)) == {out[0].endpoint, fallback.endpoint}


def test_pick_request_from_a_parsed_request():
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi there"}], "n": 2}'
    ir = parse_inference_request("chat", body)
    headers = RoutingHeaders(tenant="t", priority=7, deadline_ms=1500, session_id="s1")
    pr = PickRequest.build(ir, headers, 10.0, block_hashes=[1, 2], default_max_tokens=100)
    assert (pr.model, pr.prompt_tokens, pr.max_tokens) == ("m", ir.estimated_prompt_tokens, 200)
    assert (pr.tenant, pr.priority, pr.deadline_s, pr.context_key) == ("t", 7, 11.5, "s1")


# -- the death spiral -----------------------------------------------------------------------------


@dataclass
class SimEngine:
    """An engine with a real (unbounded) prefix cache: prefill is served FIFO at the GPU's
    speed, decode runs alongside at a fixed time per token."""

    tps: float = GPUS["H100"].prefill_tokens_per_s
    tpot_s: float = 0.01
    busy_until: float = 0.0
    cache: set[int] = field(default_factory=set)

    def submit(self, now: float, hashes: Sequence[int], prompt: int, out: int):
        hit = 0
        for h in hashes:
            if h not in self.cache:
                break
            hit += 1
        cached = min(prompt - 1, hit * 16)
        first = max(now, self.busy_until) + (prompt - cached) / self.tps + 0.008
        self.busy_until = first
        self.cache.update(hashes)
        return first, first + out * self.tpot_s, cached


class NaiveCacheAware:
    """The baseline: always the endpoint with the longest match (ties: fewest outstanding)."""

    def __init__(self) -> None:
        self.index = PrefixIndex()

    def pick(self, r: PickRequest, eps: Sequence[EndpointState], now: float) -> list[Choice]:
        m = self.index.match(r.block_hashes, now)
        best = max(eps, key=lambda e: (m.get(e.name, 0), -e.outstanding, e.name))
        self.index.record(best.name, r.block_hashes, now)
        cached = m.get(best.name, 0) * 16
        return [Choice(best.name, "", 0.0, 0.0, cached, "naive", 0.0, 0, 0.0, 0.0, best)]

    def dispatch(self, c: Choice, r: PickRequest, rid: int, now: float) -> None:
        uncached = max(1, r.prompt_tokens - c.cached_tokens)
        c.state.start(rid, now, prompt_tokens=r.prompt_tokens, uncached_tokens=uncached)


def run_fleet(make, clients: int = 1, engines: int = 4, rate: float = 250.0, n: int = 500):
    """`clients` independent pickers (each with its own view of the endpoints) send one
    shared 4k-token prefix with unique 256-token suffixes at `rate` req/s; one H100
    serves ~100 of these a second from cache."""
    sims = {f"e{i}": SimEngine() for i in range(engines)}
    pickers = [make() for _ in range(clients)]
    views = [
        {f"e{i}": EndpointState(f"e{i}", gpu="H100") for i in range(engines)}
        for _ in range(clients)
    ]
    prefix = "".join(chr(97 + (i * 7) % 26) for i in range(16_384))
    events: list[tuple[float, int, str, int, int, str]] = []
    seq = itertools.count()
    backlog = dict.fromkeys(sims, 0)
    max_backlog = 0
    prompt_tokens = cached_tokens = 0
    used = set()
    for k in range(n):
        now = k / rate
        while events and events[0][0] <= now:
            t, _, kind, rid, ci, name = heapq.heappop(events)
            if kind == "first":
                views[ci][name].first_token(rid, t)
                backlog[name] -= 1
            else:
                views[ci][name].finish(rid, t)
        ci = k % clients
        text = prefix + f"{k:08d}" * 128
        r = PickRequest("m", block_hashes(text, "m"), prompt_tokens=len(text) // 4, max_tokens=64)
        choice = pickers[ci].pick(r, list(views[ci].values()), now)[0]
        first, done, cached = sims[choice.endpoint].submit(now, r.block_hashes, r.prompt_tokens, 64)
        pickers[ci].dispatch(choice, r, k, now)
        backlog[choice.endpoint] += 1
        max_backlog = max(max_backlog, backlog[choice.endpoint])
        used.add(choice.endpoint)
        prompt_tokens += r.prompt_tokens
        cached_tokens += cached
        heapq.heappush(events, (first, next(seq), "first", k, ci, choice.endpoint))
        heapq.heappush(events, (done, next(seq), "done", k, ci, choice.endpoint))
    return max_backlog, used, cached_tokens / prompt_tokens


@pytest.mark.parametrize("clients", [1, 4])
def test_death_spiral_naive_piles_up_meshd_spreads(clients):
    naive_backlog, naive_used, naive_hit = run_fleet(NaiveCacheAware, clients)
    backlog, used, hit = run_fleet(Picker, clients)
    # Naive: everything on the one engine with the cache; its queue grows with the run
    # (2.5x what it can serve), the others idle.
    assert len(naive_used) == 1 and naive_backlog > 300
    # meshd: spreads to more engines, keeps the worst queue bounded, keeps hitting.
    assert len(used) >= 2
    assert backlog <= 40 and backlog * 8 < naive_backlog
    assert hit >= 0.9 and hit >= naive_hit - 0.02


def test_client_supplied_names_do_not_grow_memory_without_bound():
    from filters.picker import MAX_REQUEST_CLASSES

    eps = fleet("H100", "H100")
    p = Picker(PickerConfig(group_map_size=16))
    for k in range(MAX_REQUEST_CLASSES + 50):
        p.pick(req(f"{k:06d}" * 20, model=f"model-{k}"), eps, float(k))
    assert len(p._kkeys) <= MAX_REQUEST_CLASSES
    assert all(len(e._pick_view.cold) <= MAX_REQUEST_CLASSES for e in eps)
    assert len(p._groups) == 16


def test_forget_drops_the_endpoint_everywhere():
    eps = fleet("H100", "H100")
    p = Picker()
    r = req(SYSTEM)
    p.pick(r, eps, 0.0)
    gone = p.pick(r, eps, 0.0)[0].endpoint
    p.forget(gone)
    assert gone not in p.index.match(r.block_hashes, 0.0)
    rest = [e for e in eps if e.name != gone]
    assert names(p.pick(r, rest, 0.0)) == [rest[0].name]


def test_direct_field_changes_need_touch():
    eps = fleet("H100", "H100")
    p = Picker()
    assert len(p.pick(PickRequest("m"), eps, 0.0)) == 2
    eps[0].models = frozenset({"other"})
    eps[0].touch()
    assert names(p.pick(PickRequest("m"), eps, 0.0)) == ["e1"]


def test_a_restarted_engine_learns_its_speed_again() -> None:
    # Issue #21's item 7: a restart (a new epoch) may be on another node, another GPU;
    # its TTFT and decode calibration start over. Same epoch, first report, unset epoch:
    # kept.
    from filters.endpoint_state import EndpointState, ReportedState

    e = EndpointState("a")
    e.ttft_ratio, e.decode_ratio = 2.5, 1.7
    e.report(ReportedState(epoch="e1"), 0.0)  # the first report: nothing to compare
    assert (e.ttft_ratio, e.decode_ratio) == (2.5, 1.7)
    e.report(ReportedState(epoch="e1"), 1.0)
    assert (e.ttft_ratio, e.decode_ratio) == (2.5, 1.7)
    e.report(ReportedState(epoch="e2"), 2.0)
    assert (e.ttft_ratio, e.decode_ratio) == (1.0, 1.0)
    e.ttft_ratio = 3.0
    e.report(ReportedState(epoch=""), 3.0)  # an unset epoch says nothing
    e.report(ReportedState(epoch=""), 4.0)
    assert e.ttft_ratio == 3.0


# -- an overload refusal holds the endpoint (issue #21: a refusing engine looked idle) --------


def test_refusals_in_a_row_hold_an_endpoint_longer_and_a_first_token_ends_the_streak() -> None:
    from filters.endpoint_state import REFUSAL_HOLD_MAX_S, REFUSAL_HOLD_S

    e = EndpointState("a")
    holds = [e.refused(10.0) for _ in range(8)]
    assert holds[:3] == [REFUSAL_HOLD_S, 2 * REFUSAL_HOLD_S, 4 * REFUSAL_HOLD_S]
    assert max(holds) == REFUSAL_HOLD_MAX_S == holds[-1]
    assert e.refused_until == 10.0 + REFUSAL_HOLD_MAX_S
    assert e.next_change(10.0) == 10.0 + REFUSAL_HOLD_MAX_S  # views rebuild when it ends
    assert e.refused(11.0, 2.5) == 2.5  # a Retry-After is taken as said...
    assert e.refused_until == 10.0 + REFUSAL_HOLD_MAX_S  # ...never shortening a hold
    e.start("r", 12.0, prompt_tokens=10)
    e.first_token("r", 12.5)
    assert e.refusals == 0
    assert e.refused(20.0) == REFUSAL_HOLD_S


def test_a_held_endpoint_is_not_the_primary_until_its_hold_ends() -> None:
    eps = [EndpointState(f"e{i}", url=f"http://e{i}", gpu="H100") for i in range(2)]
    p = Picker()
    r = PickRequest("m", (42,), prompt_tokens=500, max_tokens=64)
    first = p.pick(r, eps, 0.0, record=False)[0].endpoint
    held = next(e for e in eps if e.name == first)
    hold = held.refused(0.0)
    out = p.pick(r, eps, 0.1, record=False)
    assert out[0].endpoint != first
    # Its predicted TTFT carries the rest of the hold; once over, it is the pick again.
    mine = next(c for c in out if c.endpoint == first)
    assert mine.predicted_ttft_s >= hold - 0.1
    assert p.pick(r, eps, hold + 0.01, record=False)[0].endpoint == first


def test_a_queue_that_gives_no_first_token_is_late_and_its_lateness_counts() -> None:
    # Issue #21's hung engine: its queue was taken to drain by the clock, so it looked idle
    # and every first pick waited there for the first-byte timeout.
    from filters.picker import OVERDUE_FACTOR, OVERDUE_MIN_S

    eps = [EndpointState(f"e{i}", url=f"http://e{i}", gpu="H100") for i in range(2)]
    p = Picker()
    stuck = PickRequest("m", (7,), prompt_tokens=2000, max_tokens=64)
    c = p.pick(stuck, eps, 0.0)[0]
    p.dispatch(c, stuck, "stuck", 0.0)
    hung = c.state
    other = next(e for e in eps if e is not hung)
    for i in range(3):  # the other engine is busier: three streams decoding
        other.start(("d", i), 0.0, prompt_tokens=500, max_tokens=500)
        other.first_token(("d", i), 0.05)
    r = PickRequest("m", (99,), prompt_tokens=500, max_tokens=64)

    def ttft(now: float) -> float:
        out = p.pick(r, eps, now, record=False)
        return next(x.predicted_ttft_s for x in out if x.state is hung)

    due = OVERDUE_FACTOR * c.predicted_ttft_s + OVERDUE_MIN_S
    early = ttft(0.2)
    assert early < 1.0  # its queue is taken to drain, as predicted
    assert ttft(due + 5.0) >= 5.0  # late by 5 s: 5 s more queue, and it grows
    assert ttft(due + 9.0) >= 9.0
    assert p.pick(r, eps, due + 5.0, record=False)[0].state is other
    # A first token ends it: the queue is what it is again.
    hung.first_token("stuck", due + 9.5)
    assert ttft(due + 9.6) < 1.0
