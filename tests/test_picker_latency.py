"""Picker: the whole request predicted (its decode at the step of the batch it joins, the
context that batch holds, and the delay it adds to the streams there), the decode step
learnt from the streams' inter-token latency, and a fixed fleet's J (latency first) against
an elastic pool's (cost in full). Fake clock throughout."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.endpoint_state import CALIBRATION_RANGE, DECODE_MIN_TOKENS, EndpointState
from filters.gpu import GPUS
from filters.picker import FIXED_COST_WEIGHT, Picker, PickerConfig, PickRequest

H100 = GPUS["H100"]


def fleet(*gpus: str) -> list[EndpointState]:
    return [EndpointState(f"e{i}", url=f"http://e{i}", gpu=g) for i, g in enumerate(gpus)]


def decoding(e: EndpointState, rid: str, prompt: int, max_tokens: int = 200) -> None:
    """A request of ours decoding on e (its first token has come)."""
    e.start(rid, 0.0, prompt_tokens=prompt, max_tokens=max_tokens)
    e.first_token(rid, 0.0)


def stream(
    p: Picker, eps: list[EndpointState], r: PickRequest, rid: int, now: float, slowdown: dict
) -> float:
    """Route r, serve it at its endpoint's predicted step x slowdown[endpoint]; the end."""
    c = p.pick(r, eps, now)[0]
    p.dispatch(c, r, rid, now)
    first = now + c.predicted_ttft_s
    c.state.first_token(rid, first)
    end = first + (r.max_tokens - 1) * c.step_s * slowdown[c.endpoint]
    c.state.finish(rid, end, output_tokens=r.max_tokens)
    return end


# -- the decode calibration (EndpointState) ----------------------------------------------------


def test_a_stream_teaches_the_decode_step():
    e = EndpointState("e", gpu="H100")
    e.start("a", 0.0, prompt_tokens=100, max_tokens=64, step_s=0.01)
    e.first_token("a", 0.1)
    e.finish("a", 0.1 + 63 * 0.02, output_tokens=64)  # 20 ms between tokens, 10 predicted
    assert e.decode_ratio == pytest.approx(1.0 + 0.1 * (2.0 - 1.0))


@pytest.mark.parametrize(
    "why",
    ["no first token", "too few tokens", "failed", "no prediction", "no count"],
)
def test_what_is_no_decode_sample(why):
    e = EndpointState("e", gpu="H100")
    e.start(
        "a", 0.0, prompt_tokens=100, max_tokens=64, step_s=0.0 if why == "no prediction" else 0.01
    )
    if why != "no first token":
        e.first_token("a", 0.1)
    out = {"too few tokens": DECODE_MIN_TOKENS - 1, "no count": None}.get(why, 64)
    e.finish("a", 5.0, ok=why != "failed", output_tokens=out)
    assert e.decode_ratio == 1.0


@settings(max_examples=200, deadline=None)
@given(
    itl=st.floats(min_value=0.0, max_value=100.0, allow_nan=False),
    step=st.floats(min_value=1e-4, max_value=1.0, allow_nan=False),
    n=st.integers(min_value=DECODE_MIN_TOKENS, max_value=10_000),
    samples=st.integers(min_value=1, max_value=60),
)
def test_the_decode_ratio_stays_in_range(itl, step, n, samples):
    e = EndpointState("e", gpu="H100")
    for i in range(samples):
        e.start(i, 0.0, prompt_tokens=1, max_tokens=n, step_s=step)
        e.first_token(i, 0.0)
        e.finish(i, itl * (n - 1), output_tokens=n)
    lo, hi = CALIBRATION_RANGE
    assert lo <= e.decode_ratio <= hi


# -- the step model ----------------------------------------------------------------------------


def test_the_step_grows_with_the_context_the_batch_holds():
    # Two H100s, 4 streams each; e0's hold 30k tokens each, e1's 1k. A request that decodes
    # 500 tokens joins the batch that streams less KV per step.
    eps = fleet("H100", "H100")
    for i in range(4):
        decoding(eps[0], f"long{i}", 30_000)
        decoding(eps[1], f"short{i}", 1_000)
    p = Picker()
    r = PickRequest("m", (), prompt_tokens=100, max_tokens=500)
    out = {c.endpoint: c for c in p.pick(r, eps, 0.0, record=False)}
    assert out["e1"].rank == 0
    base, per_seq, kv = H100.decode_step_parts()
    # The uncalibrated step the request was predicted to join: 5 sequences, their context
    # (prompts + half their outputs) and its own (prompt + half its output).
    own = 100 + 250
    held_long = 4 * (30_000 + 100)
    assert out["e0"].step_s == pytest.approx(base + per_seq * 5 + kv * (held_long + own))


def test_a_slow_decoder_nobody_named_is_learnt():
    # Two engines, neither GPU named; e0 turns out to decode 1.7x slower (an A100 in an
    # H100 fleet). After streams on both, long outputs go to e1 (a tie would go to e0).
    eps = fleet("unknown", "unknown")
    p = Picker()
    slowdown = {"e0": 1.7, "e1": 1.0}
    now = 0.0
    for k in range(40):
        r = PickRequest("m", (), prompt_tokens=50, max_tokens=64)
        # Alternate by hand: both must serve to be learnt.
        c = p.pick(r, eps[k % 2 : k % 2 + 1], now)[0]
        p.dispatch(c, r, k, now)
        c.state.first_token(k, now + 0.01)
        c.state.finish(k, now + 0.01 + 63 * c.step_s * slowdown[c.endpoint], output_tokens=64)
        now += 2.0
    assert eps[1].decode_ratio == pytest.approx(1.0, abs=0.05)
    assert eps[0].decode_ratio > 1.5
    long = PickRequest("m", (), prompt_tokens=50, max_tokens=1_000)
    assert p.pick(long, eps, now, record=False)[0].endpoint == "e1"


def test_the_learnt_ratio_converges_through_the_picker():
    (e,) = fleet("H100")
    p = Picker()
    now = 0.0
    for k in range(60):
        now = stream(
            p, [e], PickRequest("m", (), prompt_tokens=200, max_tokens=128), k, now, {"e0": 1.3}
        )
        now += 1.0
    assert e.decode_ratio == pytest.approx(1.3, rel=0.02)


# -- what J weighs -----------------------------------------------------------------------------


def test_a_fixed_fleet_spreads_what_an_elastic_pool_packs():
    # e0 has one long stream running, e1 is idle. Joining e0's batch costs a share of a
    # step (an elastic pool's packing pull); on a fixed fleet the idle GPU is paid for
    # anyway, and (a second of decode valued like one of TTFT) the request's own decode
    # and the delay it adds to e0's stream decide.
    def world() -> list[EndpointState]:
        eps = fleet("H100", "H100")
        decoding(eps[0], "partner", 2_000, max_tokens=4_000)
        return eps

    r = PickRequest("m", (), prompt_tokens=1, max_tokens=256)
    elastic = Picker(PickerConfig(elastic=True, decode_weight=0.0))
    assert elastic.pick(r, world(), 0.0, record=False)[0].endpoint == "e0"
    fixed = Picker(PickerConfig(decode_weight=1.0))
    assert fixed.pick(r, world(), 0.0, record=False)[0].endpoint == "e1"


def test_the_fixed_fleet_weighs_cost_less():
    eps = fleet("H100")
    r = PickRequest("m", (), prompt_tokens=1_000, max_tokens=0)
    fixed = Picker(PickerConfig(lambda_usd_per_s=0.0)).pick(r, eps, 0.0, record=False)[0]
    elastic = Picker(PickerConfig(lambda_usd_per_s=0.0, elastic=True)).pick(r, eps, 0.0)[0]
    # With no value on time, J is the dollars alone, at the fleet's weight.
    assert elastic.score == pytest.approx(elastic.predicted_cost_usd)
    assert fixed.score == pytest.approx(FIXED_COST_WEIGHT * fixed.predicted_cost_usd)


def test_decode_weight_zero_prices_the_first_token_only():
    eps = fleet("H100", "H100")
    decoding(eps[0], "partner", 30_000)
    r = PickRequest("m", (), prompt_tokens=10, max_tokens=500)
    a = {c.endpoint: c.score for c in Picker(PickerConfig(decode_weight=0.0)).pick(r, eps, 0.0)}
    eps2 = fleet("H100", "H100")
    decoding(eps2[0], "partner", 30_000)
    b = {c.endpoint: c.score for c in Picker().pick(r, eps2, 0.0)}
    # The busy engine's decode (and the delay to its partner) is what the weight adds.
    assert b["e0"] - a["e0"] > b["e1"] - a["e1"] > 0.0


def test_the_weights_must_not_be_negative():
    with pytest.raises(ValueError, match="decode_weight"):
        PickerConfig(decode_weight=-1.0)
    with pytest.raises(ValueError, match="prefill_delay_weight"):
        PickerConfig(prefill_delay_weight=-1.0)


def test_a_prefill_delays_the_streams_running_there():
    # Eight streams decode on e0; a prompt with nothing to decode would still stall each
    # of them for its prefill (the engine interleaves it with their steps): J carries
    # r x W x inv at the prefill-delay weight (W: the prefill's work, attention included).
    def world() -> list[EndpointState]:
        eps = fleet("H100", "H100")
        for i in range(8):
            decoding(eps[0], f"s{i}", 500)
        return eps

    r = PickRequest("m", (), prompt_tokens=8_000, max_tokens=0)
    off = {c.endpoint: c for c in Picker().pick(r, world(), 0.0)}
    on_config = PickerConfig(prefill_delay_weight=1.0)
    on = {c.endpoint: c for c in Picker(on_config).pick(r, world(), 0.0)}
    lam = PickerConfig().lambda_usd_per_s
    inv = 1.0 / H100.prefill_tokens_per_s  # nominal: no calibration yet
    added = on["e0"].score - off["e0"].score
    assert added == pytest.approx(
        lam * 8 * H100.prefill_work(8_000) * inv * (1 - 8 / H100.max_num_batched_tokens) ** -1,
        rel=1e-6,
    )
    assert on["e1"].score == pytest.approx(off["e1"].score)  # nothing runs on e1


# -- the calibrations' evidence ages (issue #21: a recovered engine gets traffic back) ---------


def slow_samples(e: EndpointState, n: int, ratio: float, t0: float = 0.0) -> float:
    """n TTFT and decode samples at `ratio` x the prediction, one a second from t0; the
    time of the last."""
    t = t0
    for k in range(n):
        t = t0 + k
        e.start(("s", t0, k), t, prompt_tokens=1000, max_tokens=64, nominal_s=0.1, step_s=0.01)
        e.first_token(("s", t0, k), t + 0.1 * ratio)
        e.finish(("s", t0, k), t + 0.1 * ratio + 63 * 0.01 * ratio, output_tokens=64)
    return t + 0.1 * ratio + 63 * 0.01 * ratio


def test_stale_evidence_ages_back_toward_the_table():
    from filters.endpoint_state import CALIBRATION_HALF_LIFE_S, CALIBRATION_STALE_S

    e = EndpointState("e", gpu="H100")
    slow_samples(e, 40, 4.0)
    learnt, at, _ = e.ttft_sampled
    assert learnt == e.ttft_ratio > 3.5 and e.decode_ratio > 3.5
    e.age_calibration(at + CALIBRATION_STALE_S - 0.5)  # still fresh: unchanged
    assert e.ttft_ratio == learnt
    # One half-life past staleness: the log halved.
    e.age_calibration(at + CALIBRATION_STALE_S + CALIBRATION_HALF_LIFE_S)
    assert e.ttft_ratio == pytest.approx(learnt**0.5, rel=1e-9)
    d_learnt, d_at, _ = e.decode_sampled
    keep = 0.5 ** ((at - d_at) / CALIBRATION_HALF_LIFE_S + 1.0)
    assert e.decode_ratio == pytest.approx(d_learnt**keep, rel=1e-9)
    end = max(at, d_at)
    # Long idle: back at the table, and the view settles (no more ageing deadlines).
    late = end + CALIBRATION_STALE_S + 20 * CALIBRATION_HALF_LIFE_S
    e.age_calibration(late)
    assert (e.ttft_ratio, e.decode_ratio) == (1.0, 1.0)
    assert e.next_change(late) == float("inf")


def test_a_sample_after_long_idle_weighs_more_so_a_still_slow_engine_is_relearnt_fast():
    e = EndpointState("e", gpu="H100")
    end = slow_samples(e, 40, 4.0)
    # 200 s later, one sample at 4x again: the faded evidence gives way to it by half.
    slow_samples(e, 1, 4.0, t0=end + 200.0)
    assert e.ttft_ratio == pytest.approx(1.0 + 0.5 * (4.0 - 1.0), rel=1e-6)
    # Fresh evidence keeps the usual weight: the next sample moves it by 0.1 only.
    before = e.ttft_ratio
    slow_samples(e, 1, 1.0, t0=end + 201.5)
    assert e.ttft_ratio == pytest.approx(before + 0.1 * (1.0 - before), rel=1e-6)


def test_an_engine_in_use_keeps_its_calibration_without_samples():
    # Follow-up turns mostly cached give no TTFT sample (Picker.dispatch): an engine kept
    # busy with them must not drift back to its datasheet; only a shunned one ages.
    e = EndpointState("e", gpu="H100")
    end = slow_samples(e, 40, 4.0)
    learnt = e.ttft_ratio
    for k in range(60):  # a request a second, none giving a sample (nominal_s 0)
        t = end + 1.0 + k
        e.start(("c", k), t, prompt_tokens=1000, nominal_s=0.0)
        e.first_token(("c", k), t + 0.05)
        e.finish(("c", k), t + 0.5)
        e.age_calibration(t + 0.6)
    assert e.ttft_ratio == learnt
    # Then shunned: it ages from the last request sent there.
    e.age_calibration(end + 60.0 + 5.0 + 5.0 + 1.0)
    assert e.ttft_ratio < learnt


def test_a_busy_engines_calibration_does_not_age():
    e = EndpointState("e", gpu="H100")
    end = slow_samples(e, 200, 3.0)  # a sample every second for 200 s
    assert e.ttft_ratio == pytest.approx(3.0, rel=0.01)
    assert e.next_change(end) > end  # an ageing step is due, at staleness
    e.age_calibration(end + 1.0)
    assert e.ttft_ratio == pytest.approx(3.0, rel=0.01)


def test_a_recovered_engine_wins_picks_again():
    # e0 was learnt 4x slow and then got nothing: right after, every pick avoids it; once
    # its evidence has aged, it is an equal again and takes its share of cold prompts.
    eps = fleet("H100", "H100")
    end = slow_samples(eps[0], 40, 4.0)
    p = Picker()

    def share(now: float) -> int:
        reqs = [PickRequest("m", (k * 7919 + 1,), prompt_tokens=2000) for k in range(200)]
        return sum(p.pick(r, eps, now, record=False)[0].endpoint == "e0" for r in reqs)

    assert share(end + 1.0) == 0
    assert 60 <= share(end + 120.0) <= 140
