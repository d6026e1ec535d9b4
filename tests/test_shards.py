"""meshd/shards.py: rendezvous hashing of engines over control-plane shards."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.shards import parse_shard, shard_for

SHARDS = [(f"cp-{i}:15010",) for i in range(4)]
ENGINES = [f"vllm-{i:04d}" for i in range(4000)]


def test_engines_spread_evenly_and_the_choice_is_stable():
    counts = Counter(shard_for(e, SHARDS) for e in ENGINES)
    assert set(counts) == set(SHARDS)
    assert max(counts.values()) < 1.15 * len(ENGINES) / len(SHARDS)
    assert [shard_for(e, SHARDS) for e in ENGINES[:50]] == [
        shard_for(e, list(reversed(SHARDS))) for e in ENGINES[:50]
    ]  # the list's order does not matter


def test_a_shard_added_takes_only_its_share_and_moves_nothing_else():
    before = {e: shard_for(e, SHARDS) for e in ENGINES}
    grown = [*SHARDS, ("cp-4:15010",)]
    after = {e: shard_for(e, grown) for e in ENGINES}
    moved = [e for e in ENGINES if before[e] != after[e]]
    assert all(after[e] == ("cp-4:15010",) for e in moved)
    assert 0.15 * len(ENGINES) < len(moved) < 0.25 * len(ENGINES)  # ~1/5


@given(st.text(min_size=1), st.lists(st.text(min_size=1), min_size=1, max_size=6, unique=True))
def test_the_chosen_shard_is_one_of_them(engine, names):
    shards = [(n,) for n in names]
    assert shard_for(engine, shards) in shards


def test_a_shard_names_its_replicas():
    assert parse_shard(" a:1, b:1 ") == ("a:1", "b:1")
    with pytest.raises(ValueError, match="at least one"):
        parse_shard(" , ")
    with pytest.raises(ValueError, match="no control-plane shard"):
        shard_for("e", [])
