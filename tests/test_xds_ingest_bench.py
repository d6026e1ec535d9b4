"""loadtest/xds_ingest_bench.py runs end to end on a tiny load, over both transports and
with mTLS, and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import xds_ingest_bench


def test_the_ingest_bench_measures_each_batch_size(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    argv = ["--batches", "1,5", "--updates", "1200", "--streams", "2", "--rounds", "1"]
    rc = xds_ingest_bench.main([*argv, "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["us_per_update"]) == {"grpc", "frames"}
    assert doc["grpc_us_per_update"] == doc["us_per_update"]["grpc"]
    for row in doc["us_per_update"].values():
        assert set(row) == {"1", "5"} and all(v >= 0 for v in row.values())
    assert doc["publish_call_us"] > 0


def test_the_ingest_bench_runs_with_mtls(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    argv = ["--transports", "frames", "--batches", "1", "--updates", "200", "--streams", "2"]
    assert xds_ingest_bench.main([*argv, "--rounds", "1", "--tls", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())["us_per_update"]) == {"frames"}
