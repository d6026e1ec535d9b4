"""loadtest/xds_memory_bench.py in miniature: its digests are PrefixDigests as the agents
encode them, and a run over real processes measures every phase and says PASS or FAIL."""

from __future__ import annotations

import json
from pathlib import Path

from filters.endpoint_state import ReportedBlocks
from loadtest import xds_memory_bench as bench
from xds.resources import PrefixDigest, decode_prefix_digest


def test_an_engines_digests_are_a_base_and_deltas_on_it() -> None:
    e = bench.EngineDigests(5, blocks=300, delta_blocks=7)
    held = ReportedBlocks()
    first = decode_prefix_digest(e.full())
    assert (first.full, first.seq, len(set(first.added))) == (True, 1, 300)
    assert e.full() != e.full()  # a resync is a new set
    base = decode_prefix_digest(e.full())
    assert held.apply(base, 0.0) is not None
    delta = decode_prefix_digest(e.delta())
    assert (delta.full, delta.base_seq, len(delta.added), len(delta.removed)) == (
        False,
        base.seq,
        7,
        7,
    )
    assert set(delta.removed) <= set(base.added)
    assert held.apply(delta, 0.0) is not None
    assert held.blocks == (frozenset(base.added) - set(delta.removed)) | set(delta.added)
    assert (
        bench.digest_bytes(5, 9, 9, (1).to_bytes(8, "little"))
        == PrefixDigest(bench.engine_name(5), f"{5:08x}", 9, 9, True, 16, (1,)).encode()
    )


def test_a_small_run_measures_every_phase_and_a_digest_is_held_once(
    tmp_path: Path, capsys: object
) -> None:
    """48 engines of 40,000-block digests over 12 publish streams: a block costs its own
    8 bytes and a little (9-11 measured), not twice that (21 before each body was held
    once and a stream stopped holding the message it received last)."""
    out = tmp_path / "memory.json"
    rc = bench.main(
        [
            "--engines", "48", "--blocks", "40000", "--per-message", "4", "--subscribers", "2",
            "--follow", "8", "--churn-s", "0.5", "--rate", "4", "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    phases = {p["name"]: p for p in doc["now"]}
    assert list(phases) == list(bench.PHASES)
    for p in phases.values():
        assert 20 < p["settled_mib"] <= p["peak_mib"] + 1
    grew = (phases["restart"]["settled_mib"] - phases["states"]["settled_mib"]) * 2**20
    assert grew / (48 * 40_000) < 14.0
    text = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "a digest block:" in text and ("PASS: RSS" in text or "FAIL: RSS" in text)
