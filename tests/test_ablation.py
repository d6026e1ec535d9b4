"""loadtest/bench/ablation.py: every switch builds a router that differs from the default
in what it names, and the verdict reads the ratios the right way round."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.bench.ablation import ABLATIONS, FULL, report, verdicts
from loadtest.bench.virtual import sidecar_model

URLS = ["http://e0:8000", "http://e1:8000"]


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_each_switch_changes_what_it_names(name):
    base = sidecar_model(URLS, "meshd")
    off = sidecar_model(URLS, "meshd", overrides=ABLATIONS[name])
    spec = ABLATIONS[name]
    if "picker_config" in spec:
        got = dataclasses.asdict(off.router.picker.config)  # type: ignore[attr-defined]
        want = dataclasses.asdict(base.router.picker.config)  # type: ignore[attr-defined]
        changed = {k for k in got if got[k] != want[k]}
        assert changed == set(spec["picker_config"])
    elif "refuse_predicted_late" in spec["reliability"]["admission"]:
        assert base.refuse_late and not off.refuse_late
    else:
        assert base.admission is not None and off.admission is not None
        assert off.admission.config != base.admission.config


def row(label: str, name: str, **figs: float) -> dict:
    base = {"ttft_p90": 1.0, "ttft_p99": 2.0, "e2e_p50": 3.0, "hit_rate": 0.5, "makespan_p50": None}
    return {"label": label, "ablation": name, "figures": {**base, **figs}}


def test_the_verdict_counts_a_lower_hit_rate_and_a_higher_latency_as_worse():
    rows = [
        row("a", FULL),
        row("b", FULL),
        row("a", "knee (lambda_knee_s)", ttft_p90=2.0),  # off: TTFT p90 doubles
        row("b", "knee (lambda_knee_s)", hit_rate=0.25),  # off: hit rate halves
        row("a", "load floor", ttft_p90=0.5),  # off: better
        row("b", "load floor"),
    ]
    v = verdicts(rows)
    assert v["knee (lambda_knee_s)"]["cells"]["a"]["ttft_p90"] == 2.0
    assert v["knee (lambda_knee_s)"]["cells"]["b"]["hit_rate"] == 2.0
    # Eight figures (four per cell; makespan absent), two of them 2.0: 2 ** (2 / 8).
    assert v["knee (lambda_knee_s)"]["worse_when_off"] == pytest.approx(2 ** (2 / 8))
    assert v["load floor"]["worse_when_off"] < 1.0
    text = report(rows)
    assert "| knee (lambda_knee_s) | 2.00 / 1.00 / 1.00 | 1.00 / 1.00 / 2.00 | **1.19** |" in text
    assert "| load floor |" in text and "**0." not in text.split("load floor")[1]
