"""Picker: decode priced for as long as the batch it joins lasts (the partners' output
tokens), past that alone. Fake clock throughout."""

from __future__ import annotations

import pytest

from filters.endpoint_state import EndpointState
from filters.gpu import GPUS
from filters.picker import Picker, PickRequest

H100, A100 = GPUS["H100"], GPUS["A100"]


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
    p = Picker()
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
    p = Picker()
    r = PickRequest("m", (), prompt_tokens=1, max_tokens=64)
    choices = {c.endpoint: c for c in p.pick(r, eps, 1.0, record=False)}
    assert choices["h100"].rank == 0
    v = eps[0]._pick_view
    assert v.decode_usd(64) == pytest.approx(decode_usd(H100, 2, 64, 1000.0))


def test_the_span_is_the_mean_output_of_our_requests_there():
    eps = fleet()
    running(eps[0], "a", max_tokens=10)
    running(eps[0], "b", max_tokens=30)
    p = Picker()
    p.pick(PickRequest("m", (), prompt_tokens=1, max_tokens=64), eps, 1.0, record=False)
    v = eps[0]._pick_view
    assert v.decode_span == 20.0
    assert v.decode_usd(64) == pytest.approx(decode_usd(H100, 3, 64, 20.0))
    # An idle engine: every step alone, whatever the span.
    assert eps[1]._pick_view.decode_usd(64) == pytest.approx(decode_usd(A100, 1, 64, 0.0))


def test_reference_pricing_has_no_span():
    from filters.picker import PickerConfig

    eps = fleet()
    running(eps[0], "short", max_tokens=2)
    p = Picker(PickerConfig(decode_pricing="reference"))
    p.pick(PickRequest("m", (), prompt_tokens=1, max_tokens=64), eps, 1.0, record=False)
    assert eps[0]._pick_view.decode_span == float("inf")
