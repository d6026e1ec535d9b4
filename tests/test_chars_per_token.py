"""The per-model chars-per-token learner (filters/chars_per_token.py) on fake samples."""

from __future__ import annotations

import random

import pytest

from filters.chars_per_token import MAX_MODELS, MIN_SAMPLES, WINDOW, CharsPerToken, utf8_length
from filters.hotpath import parse_routing_headers
from filters.picker import PickRequest
from filters.request import parse_inference_request


def feed(cpt: CharsPerToken, model: str, ratio: float, n: int, rng: random.Random) -> None:
    for _ in range(n):
        chars = rng.randrange(200, 20_000)
        cpt.observe(model, chars, chars, max(1, round(chars / ratio)))


def test_no_estimate_until_min_samples_then_the_prompt_estimate_follows():
    cpt = CharsPerToken()
    rng = random.Random(1)
    text = "x" * 1000
    feed(cpt, "m", 2.0, MIN_SAMPLES - 1, rng)
    assert cpt.ratio("m") is None
    assert cpt.prompt_tokens("m", text) == 250  # CHARS_PER_TOKEN = 4 meanwhile
    feed(cpt, "m", 2.0, 1, rng)
    r = cpt.ratio("m")
    assert r is not None and r.samples == MIN_SAMPLES
    assert r.chars == pytest.approx(2.0, rel=1e-3)
    assert cpt.prompt_tokens("m", text) == pytest.approx(500, abs=1)


def test_converges_on_noisy_samples_and_follows_a_new_tokenizer_within_a_window():
    cpt = CharsPerToken()
    rng = random.Random(2)
    for _ in range(500):
        chars = rng.randrange(200, 5000)
        cpt.observe("m", chars, chars, max(1, round(chars / rng.uniform(4.5, 5.5))))
    r = cpt.ratio("m")
    assert r is not None and r.chars == pytest.approx(5.0, rel=0.03)
    feed(cpt, "m", 3.0, WINDOW, rng)  # redeployed with another tokenizer
    r = cpt.ratio("m")
    assert r is not None and r.chars == pytest.approx(3.0, rel=1e-2)


def test_outliers_are_rejected_or_outvoted():
    cpt = CharsPerToken()
    rng = random.Random(3)
    feed(cpt, "m", 4.0, 40, rng)
    before = cpt.rejected
    assert not cpt.observe("m", 30, 30, 10)  # too short a prompt
    assert not cpt.observe("m", 10_000, 10_000, 1)  # 10,000 chars/token: a broken usage
    assert not cpt.observe("m", 1000, 1000, 100_000)  # 0.01 chars/token
    assert not cpt.observe("m", 1000, 1000, 0)
    assert not cpt.observe("m", 1000, 999, 250)  # fewer bytes than characters
    assert cpt.rejected == before + 5
    for _ in range(15):  # plausible but odd prompts (digits, base64): a minority
        cpt.observe("m", 1000, 1000, 900)
        cpt.observe("m", 1000, 1000, 40)
    r = cpt.ratio("m")
    assert r is not None and r.chars == pytest.approx(4.0, rel=0.02)


def test_models_are_learnt_apart_with_bytes_per_token_for_multibyte_text():
    cpt = CharsPerToken()
    rng = random.Random(4)
    feed(cpt, "coder", 3.0, 20, rng)
    cjk = "漢字かな交じり文" * 40  # 3 UTF-8 bytes per character
    for _ in range(20):
        cpt.observe("zh", len(cjk), utf8_length(cjk), len(cjk))  # ~1 char per token
    coder, zh = cpt.ratio("coder"), cpt.ratio("zh")
    assert coder is not None and zh is not None
    assert coder.chars == pytest.approx(3.0, rel=1e-2) and coder.bytes == coder.chars
    assert zh.chars == pytest.approx(1.0) and zh.bytes == pytest.approx(3.0)
    assert cpt.ratio("other") is None
    snap = cpt.snapshot()
    assert snap["zh"] == {"chars_per_token": 1.0, "bytes_per_token": 3.0, "samples": 20}


def test_the_cap_on_models_evicts_the_least_recently_observed():
    cpt = CharsPerToken(max_models=3, min_samples=1)
    for m in ("a", "b", "c"):
        cpt.observe(m, 400, 400, 100)
    cpt.observe("a", 400, 400, 100)  # a is fresh again; b is the oldest
    cpt.observe("d", 400, 400, 100)
    assert sorted(cpt.snapshot()) == ["a", "c", "d"]
    assert cpt.ratio("b") is None
    assert CharsPerToken().max_models == MAX_MODELS


def test_window_bounds_memory():
    cpt = CharsPerToken(window=4, min_samples=2)
    for _ in range(100):
        cpt.observe("m", 400, 400, 100)
    m = cpt._models["m"]
    assert len(m.chars_ring) == 4 and len(m.bytes_ring) == 4 and m.seen == 100


@pytest.mark.parametrize(
    "kw",
    [
        {"window": 0},
        {"min_samples": 0},
        {"min_samples": 65},
        {"max_models": 0},
        {"min_ratio": 0},
        {"min_ratio": 5, "max_ratio": 4},
    ],
)
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        CharsPerToken(**kw)


def test_pick_request_build_uses_the_learnt_ratio_and_defaults_to_the_fixed_one():
    body = b'{"model": "m", "prompt": "' + b"a" * 1001 + b'"}'
    req = parse_inference_request("completion", body)
    headers, _ = parse_routing_headers([], True)
    assert PickRequest.build(req, headers, 0.0, block_hashes=()).prompt_tokens == 250
    learnt = PickRequest.build(req, headers, 0.0, block_hashes=(), chars_per_token=2.0)
    assert learnt.prompt_tokens == 500
