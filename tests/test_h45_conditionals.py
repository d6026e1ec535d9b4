"""Per-request min()/max() of two written as conditionals (issue #22: a builtin call of two
arguments costs ~750 instructions): each gives what the builtin gave, for any inputs."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from filters import autoscale
from filters.request import CHARS_PER_TOKEN, estimate_prompt_tokens
from filters.token_breaker import TokenBreaker


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(max_size=300),
    cpt=st.one_of(st.none(), st.floats(0.05, 50.0)),
)
def test_estimate_prompt_tokens_as_max(text: str, cpt: float | None) -> None:
    want = max(1, len(text) // CHARS_PER_TOKEN) if cpt is None else max(1, int(len(text) / cpt))
    got = estimate_prompt_tokens(text, cpt)
    assert got == want and type(got) is type(want)


@settings(max_examples=150, deadline=None)
@given(ttft=st.floats(1e-6, 1e9))
def test_ttft_bin_as_min(ttft: float) -> None:
    if ttft <= autoscale._TTFT_MIN_S:
        want = 0
    else:
        b = 1 + int(math.log(ttft / autoscale._TTFT_MIN_S, autoscale._TTFT_BIN_RATIO))
        want = min(autoscale._TTFT_BINS - 1, b)
    assert autoscale._ttft_bin(ttft) == want


@settings(max_examples=150, deadline=None)
@given(
    learnt=st.one_of(st.none(), st.integers(0, 5000)),
    prompt=st.integers(-5, 10_000),
    max_tokens=st.one_of(st.none(), st.integers(-5, 10_000)),
)
def test_expected_tokens_as_min_and_max(
    learnt: int | None, prompt: int, max_tokens: int | None
) -> None:
    breaker = TokenBreaker()
    if learnt is not None:
        breaker.observe_output("m", learnt)
    cfg = breaker.config
    avg = breaker._outputs.get("m")
    if avg is None:
        output = max_tokens if max_tokens is not None else cfg.default_output_tokens
    else:
        estimate = math.ceil(cfg.output_estimate_factor * avg)
        output = estimate if max_tokens is None else min(max_tokens, estimate)
    assert breaker.expected_output("m", max_tokens) == output
    assert breaker.expected_tokens("m", prompt, max_tokens) == max(1, prompt) + output
