"""The fault campaign (loadtest/chaos.py) at its smallest: two scenarios on real processes
(simulated engines, meshd sidecar) must lose no request and keep a 503 storm's retries in
bound; its parts (limit probes at exact sizes, goodput, overrides, the CLI) on their own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest import chaos
from loadtest.bench.fleet import sim_unavailable
from loadtest.chaos import QUICK, Row, campaign, table
from loadtest.chaos_client import Outcome, limit_probes


@pytest.mark.skipif(sim_unavailable() is not None, reason=str(sim_unavailable()))
async def test_engine_faults_lose_nothing_and_a_storm_stays_in_bound(tmp_path: Path) -> None:
    rows = await campaign(["engine-reset", "all-503"], QUICK, tmp_path, True, False)
    by = {r.scenario: r for r in rows}
    for r in rows:
        assert r.skipped is None and r.sent > 0, r
        assert r.lost == 0 and r.broken == 0 and r.outlived == 0, r
        assert r.checks == [], r
    reset = by["engine-reset"]
    # every stream the engine reset went on elsewhere: the clients saw none of it
    assert reset.completed == reset.sent and reset.resumed > 0
    storm = by["all-503"]
    assert storm.failed > 0 and all(k.startswith(("HTTP 503", "HTTP 502")) for k in storm.failures)
    assert storm.amplification is not None and storm.amplification <= 1.2
    assert storm.fault_amplification is not None and storm.fault_amplification <= 1.2
    assert (tmp_path / "all-503" / "requests.jsonl").read_text().count("\n") == storm.sent
    assert "| engine-reset |" in table(rows)


def _head(raw: bytes) -> tuple[list[tuple[str, str]], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")[1:]
    return [(k, v.lstrip()) for k, _, v in (ln.partition(":") for ln in lines)], body


def test_limit_probes_sit_exactly_at_and_one_past_each_limit() -> None:
    probes = {p["name"]: p["raw"] for p in limit_probes(65536, 100, 16384)}
    assert len(_head(probes["body at limit"])[1]) == 65536
    assert len(_head(probes["body over"])[1]) == 65537
    assert len(_head(probes["headers at count"])[0]) == 100
    assert len(_head(probes["headers over count"])[0]) == 101
    size = [
        sum(len(k) + len(v) for k, v in _head(probes[n])[0])
        for n in ("header bytes at", "header bytes over")
    ]
    assert size == [16384, 16385]  # names + values, as meshd/listener.py counts them
    assert json.loads(_head(probes["body at limit"])[1])["max_tokens"] == 1


def _outcome(sent: float, ended: float, kind: Any = "completed") -> Outcome:
    return Outcome(sent, ended, kind, 200, "", 10)


def test_goodput_spreads_each_completion_over_its_life() -> None:
    outs = [_outcome(0.0, 4.0), _outcome(2.0, 4.0), _outcome(1.0, 3.0, "failed")]
    # [2, 4]: half of the first, all of the second; the failure counts for nothing
    assert chaos._goodput(outs, 2.0, 4.0) == pytest.approx(1.5 / 2.0)


def test_overrides_merge_dotted_keys_with_json_values() -> None:
    got = chaos._overrides(
        ["reliability.breaker.enabled=false", "reliability.retry.ratio=0.1", "log_level=debug"],
        {"reliability": {"outlier": {"enabled": False}}},
    )
    assert got == {
        "reliability": {
            "outlier": {"enabled": False},
            "breaker": {"enabled": False},
            "retry": {"ratio": 0.1},
        },
        "log_level": "debug",
    }


def test_cli_names_unknown_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        chaos.main(["--scenarios", "baseline,meteor-strike"])
    assert exc.value.code == 2 and "meteor-strike" in capsys.readouterr().err


def test_cli_writes_the_rows_and_fails_on_a_missed_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def fake(names: Any, s: Any, workdir: Path, quiet: bool, in_netns: bool) -> list[Row]:
        return [
            Row("baseline", "no fault", sent=3, completed=3, amplification=1.0, outlived=0),
            Row("latency", "netem", skipped="tc netem does not work here"),
            Row("all-503", "storm", sent=2, failed=2, checks=["amplification 1.5 > 1.2"]),
        ]

    monkeypatch.setattr(chaos, "campaign", fake)
    out = tmp_path / "chaos.json"
    code = chaos.main(["--scenarios", "baseline,latency,all-503", "--json", str(out), "--quiet"])
    doc = json.loads(out.read_text())
    assert code == 1
    assert {"date", "machine", "settings", "rows"} <= doc.keys()
    assert [r["scenario"] for r in doc["rows"]] == ["baseline", "latency", "all-503"]
    assert doc["rows"][1]["skipped"] == "tc netem does not work here"
    text = table([Row(**r) for r in doc["rows"]])
    assert "| latency | skipped: tc netem does not work here |" in text
