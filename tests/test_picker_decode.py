"""Picker: decode priced for as long as the batch it joins lasts (the partners' output
tokens), past that alone; a second of TTFT valued less for a request whose first token
comes well inside the knee anyway (lambda_knee_s). Fake clock throughout."""

from __future__ import annotations

import pytest

from filters.endpoint_state import EndpointState
from filters.gpu import GPUS
from filters.picker import Picker, PickerConfig, PickRequest

H100, A100 = GPUS["H100"], GPUS["A100"]
# These tests are about the dollars (an elastic pool) and the TTFT's value; J's decode
# seconds are off (tests/test_picker_latency.py has them).
COST = {"elastic": True, "decode_weight": 0.0}


def fleet() -> list[EndpointState]:
    return [
        EndpointState("h100", url="http://h100", gpu="H100"),
        EndpointState("a100", url="http://a100", gpu="A100"),
    ]


def running(e: EndpointState, rid: str, max_tokens: int, now: float = 0.0) -> None:
    """A request of ours decoding on e (its first token has come)."""
    e.start(rid, now, prompt_tokens=8, max_tokens=max_tokens)
    e.first_token(rid, now)


def decode_usd(gpu, batch: int, m: int, span: float) -> float:
    share = gpu.price_per_s * gpu.decode_step_s(batch) / batch
    alone = gpu.price_per_s * gpu.decode_step_s(1)
    return min(m, span) * share + max(0.0, m - span) * alone


def test_a_batch_about_to_finish_is_no_discount_for_a_long_decode():
    # The H100 runs one request of ours with 2 output tokens: a 64-token decode shares
    # its first 2 steps and runs the other 62 alone. Priced at the batch of 2 throughout
    # (0.5 of an H100 step, cheaper than a whole A100 step) it stayed on the H100.
    eps = fleet()
    running(eps[0], "short", max_tokens=2)
    p = Picker(PickerConfig(**COST))
    r = PickRequest("m", (), prompt_tokens=1, max_tokens=64)
    choices = {c.endpoint: c for c in p.pick(r, eps, 1.0, record=False)}
    assert choices["a100"].rank == 0
    v = eps[0]._pick_view
    assert v.decode_usd(64) == pytest.approx(decode_usd(H100, 2, 64, 2.0))
    assert choices["h100"].predicted_cost_usd == pytest.approx(v.price_s * v.inv + v.decode_usd(64))


def test_a_batch_that_outlasts_the_request_still_pulls_it():
    # The partner has 1,000 tokens to go: the request shares every step (the packing pull).
    eps = fleet()
    running(eps[0], "long", max_tokens=1000)
    p = Picker(PickerConfig(**COST))
    r = PickRequest("m", (), prompt_tokens=1, max_tokens=64)
    choices = {c.endpoint: c for c in p.pick(r, eps, 1.0, record=False)}
    assert choices["h100"].rank == 0
    v = eps[0]._pick_view
    assert v.decode_usd(64) == pytest.approx(decode_usd(H100, 2, 64, 1000.0))


def test_the_span_is_the_mean_output_of_our_requests_there():
    eps = fleet()
    running(eps[0], "a", max_tokens=10)
    running(eps[0], "b", max_tokens=30)
    p = Picker(PickerConfig(**COST))
    p.pick(PickRequest("m", (), prompt_tokens=1, max_tokens=64), eps, 1.0, record=False)
    v = eps[0]._pick_view
    assert v.decode_span == 20.0
    assert v.decode_usd(64) == pytest.approx(decode_usd(H100, 3, 64, 20.0))
    # An idle engine: every step alone, whatever the span.
    assert eps[1]._pick_view.decode_usd(64) == pytest.approx(decode_usd(A100, 1, 64, 0.0))


def test_reference_pricing_has_no_span():
    eps = fleet()
    running(eps[0], "short", max_tokens=2)
    p = Picker(PickerConfig(decode_pricing="reference", **COST))
    p.pick(PickRequest("m", (), prompt_tokens=1, max_tokens=64), eps, 1.0, record=False)
    assert eps[0]._pick_view.decode_span == float("inf")


# -- the TTFT knee ---------------------------------------------------------------------------


def scores(p: Picker, r: PickRequest) -> dict[str, tuple[float, float, float]]:
    eps = fleet()
    return {
        c.endpoint: (c.score, c.predicted_cost_usd, c.predicted_ttft_s)
        for c in p.pick(r, eps, 0.0, record=False)
    }


def test_a_short_prompt_may_wait_a_few_ms_for_the_cheaper_decode():
    # 1 prompt token, 16 out, idle fleet: the A100's first token comes ~4 ms later (one
    # A100 step against one H100 step) and its 16 decode steps cost 2/3 of the H100's.
    # At lambda 1e-2 the 4 ms outweighed the ~3.2e-5 $ saved; the request's best case is
    # ~7.5 ms, under the 50 ms knee by more than 4x, so a second is worth lambda / 4.
    r = PickRequest("m", (), prompt_tokens=1, max_tokens=16)
    off = scores(Picker(PickerConfig(lambda_knee_s=None, **COST)), r)
    assert min(off, key=lambda k: off[k][0]) == "h100"
    on = scores(Picker(PickerConfig(**COST)), r)
    assert min(on, key=lambda k: on[k][0]) == "a100"
    for score, cost, ttft in on.values():
        assert score == pytest.approx(cost + 1e-2 / 4 * ttft)


def test_the_discount_rounds_up_to_a_power_of_two():
    # Best case just over knee / 2: lambda itself (the marginal value there is over 1/2).
    t0 = H100.decode_step_s(1) + H100.prefill_work(100) / H100.prefill_tokens_per_s
    r = PickRequest("m", (), prompt_tokens=100, max_tokens=16)
    for knee, factor in ((1.9 * t0, 1.0), (2.0 * t0, 0.5), (4.1 * t0, 0.25)):
        got = scores(Picker(PickerConfig(lambda_knee_s=knee, **COST)), r)
        for score, cost, ttft in got.values():
            assert score == pytest.approx(cost + 1e-2 * factor * ttft), knee


def test_a_long_prompt_keeps_lambda():
    # 4,000 tokens: ~152 ms at best, over the knee, so nothing changes.
    r = PickRequest("m", (), prompt_tokens=4000, max_tokens=16)
    assert scores(Picker(PickerConfig(**COST)), r) == scores(
        Picker(PickerConfig(lambda_knee_s=None, **COST)), r
    )


def test_the_knee_must_be_positive():
    with pytest.raises(ValueError, match="lambda_knee_s"):
        PickerConfig(lambda_knee_s=0.0, **COST)


def test_requests_of_other_lambdas_share_the_views_constants():
    # lambda (priority, and the knee's discount for a short prompt) is applied in the hot
    # loop: alternating a short and a long prompt, or priorities, recomputes no view's
    # per-class constants while nothing about the endpoints changed.
    eps = fleet()
    p = Picker(PickerConfig(**COST))
    calls = []
    constants = p._constants

    def counting(v, e, kkey, now):
        calls.append(e.name)
        constants(v, e, kkey, now)

    p._constants = counting
    short = PickRequest("m", (), prompt_tokens=4, max_tokens=16)  # under the knee
    long = PickRequest("m", (), prompt_tokens=8000, max_tokens=16)
    urgent = PickRequest("m", (), prompt_tokens=4, max_tokens=16, priority=9)
    p.pick(short, eps, 1.0, record=False)
    assert sorted(calls) == ["a100", "h100"]  # the first pick of the class computes them
    calls.clear()
    for r in (long, urgent, short, long):
        p.pick(r, eps, 1.0, record=False)
    assert calls == []


def test_the_loop_prices_each_lambda_as_the_model_says():
    # J = cost + lambda x TTFT for each request's own lambda, whichever came before it.
    eps = fleet()
    p = Picker(PickerConfig(lambda_knee_s=None, **COST))
    for prio in (9, 0, 5, 9):
        r = PickRequest("m", (), prompt_tokens=2000, max_tokens=16, priority=prio)
        lam = 1e-2 * 2.0 ** (prio - 5)
        for c in p.pick(r, eps, 1.0, record=False):
            assert c.score == pytest.approx(c.predicted_cost_usd + lam * c.predicted_ttft_s)
