"""loadtest/picker_bench.py: --tail attributes the slowest picks, and leaves the classes
it instruments as they were."""

from __future__ import annotations

from collections import Counter

import pytest

from filters.picker import Picker
from filters.prefix_index import PrefixIndex
from loadtest import picker_bench


def test_tail_composition_tells_the_slow_picks_apart() -> None:
    plain = Counter({"view rebuild": 2})
    slow = Counter({"view rebuild": 3, "index expiry work": 1})
    picks = [(1000 + i, plain, False) for i in range(99)] + [(9000, slow, True)]
    middle, tail = picker_bench.tail_composition(picks)
    assert middle.strip().startswith("middle 20% (20 picks")
    assert "index expiry work 0% (0.00/pick)" in middle
    assert "none of these but view rebuilds 100%" in middle
    assert tail.strip().startswith("slowest 1% (1 picks, CPU >= 9.0 us)")
    assert "index expiry work 100% (1.00/pick)" in tail
    assert "view rebuild 100% (3.00/pick)" in tail
    assert "GC pass 100%" in tail
    assert "none of these but view rebuilds 0%" in tail


def test_tail_run_prints_and_unwraps(capsys: pytest.CaptureFixture[str]) -> None:
    before = [getattr(cls, name) for cls, name, _ in picker_bench.TAIL_EVENTS]
    args = "--endpoints 4 --tokens 256 --docs 2 --picks 200 --rounds 1 --tail"
    picker_bench.main(args.split())
    out = capsys.readouterr().out
    assert "tail composition" in out and "slowest 1% (2 picks" in out
    assert [getattr(cls, name) for cls, name, _ in picker_bench.TAIL_EVENTS] == before
    assert PrefixIndex._work is before[0] and Picker._view is before[-1]
