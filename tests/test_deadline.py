"""A request predicted to end after its deadline is refused before its first attempt
(filters/deadline.py): the pool's output fill learnt from finished answers, the predicted
end on a route, and the refusal's words."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from filters.deadline import EndPredictor, FillConfig, late_message, late_refusal
from filters.picker import PickRequest
from filters.pool_router import EndpointSpec, PickerRouter, make_router


def test_fill_starts_at_the_clients_word_and_learns_what_answers_use() -> None:
    ends = EndPredictor(FillConfig(alpha=0.5))
    assert ends.output_tokens(400) == 400.0  # before any answer: max_tokens as asked
    for rid in range(20):
        ends.dispatched(rid, 1000)
        ends.finished(rid, True, 100)  # answers stop at a tenth of max_tokens
    assert ends.fill == pytest.approx(0.1, abs=1e-4)
    assert ends.output_tokens(4000) == pytest.approx(400.0, rel=1e-3)
    assert ends.samples == 20


def test_a_failed_or_unmeasured_answer_teaches_nothing_and_is_forgotten() -> None:
    ends = EndPredictor(FillConfig(alpha=0.5))
    ends.dispatched("a", 100)
    ends.finished("a", False, 5)  # failed: cut short, says nothing of the fill
    ends.dispatched("b", 100)
    ends.finished("b", True, None)  # no usage
    ends.finished("never-dispatched", True, 1)
    assert ends.fill == 1.0 and ends.samples == 0
    assert not ends._asked


def test_the_dispatched_are_remembered_up_to_a_bound() -> None:
    ends = EndPredictor(FillConfig(max_tracked=3))
    for rid in range(10):
        ends.dispatched(rid, 10)
    assert list(ends._asked) == [7, 8, 9]


def test_end_is_the_first_token_then_the_expected_output_at_the_step() -> None:
    ends = EndPredictor(FillConfig(min_samples=0))
    assert ends.end_s(0.5, 0.02, 100) == pytest.approx(0.5 + 100 * 0.02)
    ends.fill = 0.25
    assert ends.end_s(0.5, 0.02, 100) == pytest.approx(0.5 + 25 * 0.02)


def test_no_end_is_predicted_before_the_pool_has_finished_enough_answers() -> None:
    ends = EndPredictor(FillConfig(min_samples=3))
    for rid in range(3):
        assert ends.end_s(0.5, 0.02, 100) is None  # the datasheet's guess: no refusal
        ends.dispatched(rid, 100)
        ends.finished(rid, True, 100)
    assert ends.end_s(0.5, 0.02, 100) == pytest.approx(2.5)


@pytest.mark.parametrize(
    "bad", [{"alpha": 0.0}, {"prior": 0.0}, {"prior": math.inf}, {"max_tracked": 0}]
)
def test_config_rejects_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FillConfig(**bad)  # type: ignore[arg-type]


@given(
    end=st.floats(0.0, 1e4, allow_nan=False),
    left=st.floats(-1e4, 1e4, allow_nan=False),
)
def test_refused_exactly_when_predicted_after_the_time_left(end: float, left: float) -> None:
    message = late_message("default", end, left)
    assert (message is None) == (end <= left)
    if message is not None:
        assert "'default'" in message and "deadline" in message


def _router(n: int = 2) -> PickerRouter:
    router = make_router("meshd", [EndpointSpec(f"http://e{i}:8000", gpu="H100") for i in range(n)])
    assert isinstance(router, PickerRouter)
    return router


def _req(max_tokens: int, prompt_tokens: int = 2000) -> PickRequest:
    return PickRequest(model="m", prompt_tokens=prompt_tokens, max_tokens=max_tokens)


def test_picker_router_predicts_the_whole_answer_and_learns_the_fill() -> None:
    router = _router()
    router.ends.config = FillConfig(min_samples=0)
    short, long_ = _req(10), _req(1000)
    best_short = router.order(short, 0.0)[0]
    best_long = router.order(long_, 0.0)[0]
    end_short = router.predicted_end_s(best_short, short)
    end_long = router.predicted_end_s(best_long, long_)
    assert end_short is not None and end_long is not None
    assert best_short.predicted_ttft_s is not None
    # The same prompt: the longer answer ends later by its extra output at the step.
    assert end_short > best_short.predicted_ttft_s
    assert end_long > end_short + 900 * 0.001
    # Answers that use a tenth of what they ask for: the prediction follows.
    for rid in range(200):
        req = _req(1000)
        route = router.order(req, 1.0 + rid)[0]
        router.started(route, rid, req, 1.0 + rid)
        router.finished(route, rid, req, 1.5 + rid, ok=True, completion_tokens=100)
    assert router.ends.fill == pytest.approx(0.1, abs=0.01)
    again = router.order(long_, 300.0)[0]
    end_again = router.predicted_end_s(again, long_)
    assert end_again is not None and end_again < end_long


def test_a_connect_failure_forgets_the_request() -> None:
    router = _router()
    req = _req(100)
    route = router.order(req, 0.0)[0]
    router.started(route, "r1", req, 0.0)
    router.connect_failed(route, "r1", 0.1, "refused")
    assert not router.ends._asked


@pytest.mark.parametrize("policy", ["round-robin", "least-request", "cache-aware"])
def test_the_balancer_policies_predict_nothing(policy: str) -> None:
    router = make_router(policy, [EndpointSpec("http://e0:8000")])  # type: ignore[arg-type]
    req = _req(100)
    assert router.predicted_end_s(router.order(req, 0.0)[0], req) is None


class _Router:
    def __init__(self, end: float | None) -> None:
        self.end = end

    def predicted_end_s(self, route: object, req: PickRequest) -> float | None:
        return self.end


@pytest.mark.parametrize(
    ("end", "deadline", "started", "refused"),
    [
        (2.0, 1.0, False, True),  # a new task's request predicted late
        (2.0, 1.0, True, False),  # a step of a task under way is tried
        (0.5, 1.0, False, False),  # in time
        (2.0, None, False, False),  # no deadline
        (None, 1.0, False, False),  # nothing predicted (a balancer, or before the warm-up)
    ],
)
def test_late_refusal_is_each_drivers_one_rule(
    end: float | None, deadline: float | None, started: bool, refused: bool
) -> None:
    req = PickRequest(model="m", deadline_s=None if deadline is None else 10.0 + deadline)
    got = late_refusal(_Router(end), None, req, 10.0, "p", started=started)  # type: ignore[arg-type]
    assert (got is not None) == refused
