"""`meshd cost` on the crafted log of tests/test_cost_ledger.py (numbers worked out there),
and a Mooncake trace joined with a bench run's results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cost_ledger import crafted_log

from meshd import cost_cmd

PRICES_YAML = "prices:\n  H100: 3.6\n  A100: 1.8\n"


def _write_log(tmp_path: Path) -> Path:
    log = tmp_path / "access.jsonl"
    log.write_text("".join(r.to_line() for r in crafted_log()))
    (tmp_path / "prices.yaml").write_text(PRICES_YAML)
    return log


def _row(out: str, name: str) -> list[str]:
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row {name!r} in\n{out}")


def test_cost_table_by_tenant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _write_log(tmp_path)
    prices = str(tmp_path / "prices.yaml")
    assert cost_cmd.main(["--log", str(log), "--prices", prices, "--by", "tenant"]) == 0
    out = capsys.readouterr().out
    # all: 6/9 requests ok, 2/4 tasks; $0.0165 spent; $0.00825 per ok task; 990 tokens;
    # waste $0.0115 = retries 0.001 + failed requests 0.0045 + abandoned 0.001 + tasks 0.005.
    assert _row(out, "all") == [
        "all", "6/9", "2/4", "$0.0165", "$0.008250", "$16.6667/M", "$0.001833", "121.2",
        "$0.0115", "(69.7%)", "$0.001000", "$0.004500", "$0.001000", "$0.005000",
    ]  # fmt: skip
    assert _row(out, "a")[1:5] == ["3/5", "1/3", "$0.0115", "$0.0115"]
    assert _row(out, "b")[1:5] == ["3/4", "1/1", "$0.005000", "$0.005000"]
    # Both views of the whole log. Fixed: the endpoints the log names (http://a, http://b,
    # both H100, $0.001/s each) over ts 0..1000: $2.00, $1.00 per ok task, 0.0165/2 busy.
    assert _row(out, "elastic")[1:4] == ["$0.0165", "$0.008250", "121.2"]
    assert _row(out, "fixed")[1:6] == ["$2.0000", "$1.0000", "1.0", "0.8%", "$1.9835"]
    assert "2 GPU(s) on 2 endpoint(s) seen in the log x 1,000.0 s" in out


def test_cost_fixed_fleet_as_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _write_log(tmp_path)
    # http://c never served a request: its two A100s ($0.0005/s each) are paid for anyway.
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("fleet:\n  http://a: H100\n  http://b: H100\n  http://c: [A100, 2]\n")
    argv = ["--log", str(log), "--prices", str(tmp_path / "prices.yaml"), "--fleet", str(fleet)]
    assert cost_cmd.main(argv) == 0
    out = capsys.readouterr().out
    assert _row(out, "fixed")[1:6] == ["$3.0000", "$1.5000", "0.7", "0.6%", "$2.9835"]
    assert "4 GPU(s) on 3 endpoint(s) as given x 1,000.0 s" in out
    assert _row(out, "all")[1:5] == ["6/9", "2/4", "$0.0165", "$0.008250"]  # elastic as before
    for bad in ("{}\n", "http://a: [H100, 0]\n", "http://a: [H100]\n", "- H100\n"):
        fleet.write_text(bad)
        assert cost_cmd.main(argv) == cost_cmd.EXIT_USAGE


def test_cost_by_task_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _write_log(tmp_path)
    plot = tmp_path / "cost.png"
    argv = ["--log", str(log), "--prices", str(tmp_path / "prices.yaml"), "--by", "task"]
    assert cost_cmd.main([*argv, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert _row(out, "task:T1") == ["task:T1", "a", "-", "no", "3", "$0.0100", "$0.0100", "idle"]
    assert _row(out, "task:T2")[3:7] == ["yes", "4", "$0.005000", "$0.001000"]
    assert plot.stat().st_size > 1000


def test_cost_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cost_cmd.main([]) == cost_cmd.EXIT_USAGE
    assert cost_cmd.main(["--mooncake", "x.jsonl"]) == cost_cmd.EXIT_USAGE
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n")
    assert cost_cmd.main(["--log", str(bad)]) == 1
    assert "bad.jsonl:1:" in capsys.readouterr().err


def test_mooncake_trace_joined_with_bench_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "mc.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 512, "output_length": 8, "hash_ids": [1]}\n'
        '{"timestamp": 100, "input_length": 512, "output_length": 8, "hash_ids": [1]}\n'
        '{"timestamp": 200, "input_length": 512, "output_length": 8, "hash_ids": [2]}\n'
    )
    results = tmp_path / "run"
    results.mkdir()
    # One pass: 10 measured GPU-seconds on H100 at $3.60/h = $0.01; the third request was
    # never sent. Two equal requests share the cost equally: $0.005 each.
    (results / "results.json").write_text(
        json.dumps(
            {
                "policies": [
                    {
                        "policy": "meshd",
                        "status": "ok",
                        "gpu_seconds": 10.0,
                        "wall_s": 20.0,
                        "engines": [{"gpu": "H100"}],
                    }
                ]
            }
        )
    )
    rows = [
        {"policy": "meshd", "request_id": "mc:1", "task": "mc:1", "ok": True, "output_tokens": 8,
         "prompt_tokens": 512, "sent_at_s": 0.0, "status": 200},
        {"policy": "meshd", "request_id": "mc:2", "task": "mc:2", "ok": False, "error": "http_500",
         "output_tokens": 8, "prompt_tokens": 512, "sent_at_s": 0.1, "status": 500},
    ]  # fmt: skip
    (results / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "prices.yaml").write_text(PRICES_YAML)
    argv = ["--mooncake", str(trace), "--results", str(results)]
    assert cost_cmd.main([*argv, "--prices", str(tmp_path / "prices.yaml")]) == 0
    out = capsys.readouterr().out
    assert "trace: 3 requests; 2 matched" in out
    row = _row(out, "meshd")
    # $0.01 over 1 ok task; waste: the failed request's half.
    assert row[1:5] == ["1/2", "1/2", "$0.0100", "$0.0100"]
    assert row[-6] == "$0.005000"  # failed requests
    # Fixed: the pass's one H100 engine over its 20 s wall time, busy 10 s of them.
    assert row[-3:] == ["$0.0200", "$0.0200", "50.0%"]
