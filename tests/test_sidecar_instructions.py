"""The callgrind output reader of loadtest/sidecar_instructions.py (the run itself needs
valgrind and minutes; the reader is what decides the printed figure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.sidecar_instructions import total_instructions


def test_the_count_is_the_totals_line_when_summary_is_zero(tmp_path: Path) -> None:
    out = tmp_path / "callgrind.out"
    out.write_text("version: 1\ncmd: python\nevents: Ir\nsummary: 0\n\nfn=x\n1 5\ntotals: 1234\n")
    assert total_instructions(out) == 1234


def test_an_old_valgrind_summary_line_is_read(tmp_path: Path) -> None:
    out = tmp_path / "callgrind.out"
    out.write_text("events: Ir\nsummary: 987\n")
    assert total_instructions(out) == 987


def test_a_file_without_counts_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "callgrind.out"
    out.write_text("events: Ir\nfn=x\n")
    with pytest.raises(ValueError, match="no totals or summary"):
        total_instructions(out)
