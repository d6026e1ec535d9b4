"""meshd's routing on the virtual-clock bench, request by request, against a recorded file
(loadtest/bench/decisions.py): a refactor must leave every decision where it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.bench.decisions import (
    RERECORD,
    WORKLOADS,
    differences,
    load,
    missing_trace,
    run_decisions,
)

RECORDED = Path(__file__).parent / "data" / "virtual_decisions.json"


def _log(_: str) -> None:
    return None


@pytest.mark.parametrize("workload", WORKLOADS)
def test_routing_decisions_unchanged(workload: str) -> None:
    reason = missing_trace(workload)
    if reason is not None:
        pytest.skip(reason)
    recorded = load(RECORDED)[workload]
    now = run_decisions(workload, _log)
    lines = differences(recorded, now)
    assert not lines, RERECORD + "\n" + "\n".join(lines)
    assert now.digest == recorded.digest
