"""loadtest/autoscale_bench.py: the desired-replicas figure follows a load step on the
virtual clock (a short run: the real one is `python -m loadtest.autoscale_bench`)."""

from __future__ import annotations

import json
from pathlib import Path

from filters.autoscale import ScalingPolicy
from loadtest.autoscale_bench import Phase, main, run, table, write


def test_the_figure_follows_a_load_step(tmp_path: Path) -> None:
    phases = [Phase(10.0, 10.0), Phase(60.0, 10.0)]
    policy = ScalingPolicy(max_replicas=16, scale_down_delay_s=60.0)
    rows = run(phases, gpus=("H100", "H100"), policy=policy, drain_s=5.0)
    before = [r.desired for r in rows if 5 <= r.t_s < 10]
    after = [r.desired for r in rows if 16 <= r.t_s <= 20]
    assert before and after
    assert max(before) < min(after)  # the step raised it...
    assert rows[-1].desired == max(r.desired for r in rows)  # ...and it has not flapped back
    assert all(r.replicas == 2 for r in rows[1:])
    # 60 req/s of 256 uncached prompt tokens (a 1024-token system prompt, cached after its
    # first use) and up to 128 completion tokens: the served prefill is near 60 x 256.
    peak = max(r.prefill_tps for r in rows)
    assert 0.7 * 60 * 256 < peak < 1.5 * 60 * 1280
    out = tmp_path / "run"
    write(rows, out, phases, {"engines": 2})
    doc = json.loads((out / "autoscale.json").read_text())
    assert len(doc["rows"]) == len(rows) and doc["phases"][1]["rate"] == 60.0
    assert (out / "autoscale.csv").read_text().count("\n") == len(rows) + 1
    assert "desired" in table(rows).splitlines()[0]


def test_the_command_line(tmp_path: Path, capsys) -> None:
    assert main(["--low", "5", "--high", "10", "--engines", "1", "--quick", "--out",
                 str(tmp_path)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "desired" in printed and "1 H100" in printed
    assert (tmp_path / "autoscale.png").exists()
