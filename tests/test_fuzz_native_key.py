"""fuzz/native.py rebuilds an instrumented module when anything it is compiled from
changes, including declarations it cimports from another package."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzz import native


def test_a_changed_pxd_in_either_package_rebuilds_every_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for package in native.PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "_m_c.pyx").write_text("x = 1\n")
    (tmp_path / "filters" / "_slots.pxd").write_text("cdef int a\n")
    monkeypatch.setattr(native, "REPO", tmp_path)
    exts = native.extensions()
    assert {e.name for e in exts} == {f"{p}._m_c" for p in native.PACKAGES}
    before = {e.name: native._key(e) for e in exts}
    (tmp_path / "filters" / "_slots.pxd").write_text("cdef int b\n")
    after = {e.name: native._key(e) for e in exts}
    assert all(after[n] != before[n] for n in before)  # xds's module too
    # Unchanged sources give the same key (the cached build is reused).
    assert after == {e.name: native._key(e) for e in exts}
    (tmp_path / "xds" / "_m_c.pyx").write_text("x = 2\n")
    again = {e.name: native._key(e) for e in exts}
    assert again["xds._m_c"] != after["xds._m_c"] and again["filters._m_c"] == after["filters._m_c"]
