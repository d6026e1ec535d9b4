"""loadtest/xds_ingest_bench.py runs end to end on a tiny load and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import xds_ingest_bench


def test_the_ingest_bench_measures_each_batch_size(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    rc = xds_ingest_bench.main(
        ["--batches", "1,5", "--updates", "1200", "--streams", "2", "--json", str(out)]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["grpc_us_per_update"]) == {"1", "5"}
    assert doc["publish_call_us"] > 0
    assert all(v >= 0 for v in doc["grpc_us_per_update"].values())
