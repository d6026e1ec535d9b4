"""filters/kv_digest.KVIndexFeed: an engine's KV events into a PrefixIndex, and the
staleness rules (restart, cleared cache, gaps and replay, silence, wrong hashes), on a
fake clock."""

from __future__ import annotations

import pytest

from filters.kv_digest import KVIndexFeed
from filters.prefix_index import PrefixIndex
from filters.vllm_blocks import VllmBlockHasher
from loadtest.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

BS = 4
HASHER = VllmBlockHasher("sha256_cbor", BS)


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def stored(toks: list[int], parent_toks: list[int] | None = None) -> BlockStored:
    """The BlockStored a vLLM engine would publish for the full blocks of toks, with the
    first len(parent_toks)//BS of them already cached."""
    hs = HASHER.hashes(toks)
    k = len(parent_toks) // BS if parent_toks else 0
    return BlockStored(hs[k:], hs[k - 1] if k else None, toks[k * BS :], BS)


class Engine:
    def __init__(self) -> None:
        self.seq = 0
        self.ts = 1000.0

    def batch(self, *events: object) -> tuple[int, bytes]:
        self.ts += 1
        seq, self.seq = self.seq, self.seq + 1
        return seq, encode_batch(self.ts, events)  # type: ignore[arg-type]


def setup(**kw: float) -> tuple[PrefixIndex, KVIndexFeed, Engine]:
    idx = PrefixIndex(track_blocks=True, ttl_s=1000.0)
    return idx, KVIndexFeed(idx, "e", verify=HASHER, **kw), Engine()


def cached(idx: PrefixIndex, toks: list[int], now: float = 0.0) -> tuple[int, float]:
    return idx.match_detail(HASHER.hashes(toks), now).get("e", (0, 0.0))


def test_stored_removed_cleared_follow_the_engine() -> None:
    idx, feed, eng = setup()
    a = tokens(6)
    b = a[: 3 * BS] + tokens(2, 100)
    feed.feed(*eng.batch(stored(a)), 0.0)
    feed.feed(*eng.batch(stored(b, a[: 3 * BS])), 0.0)
    assert cached(idx, a) == (6, 6.0) and cached(idx, b) == (5, 5.0)
    # Tail-first eviction of a's last three blocks.
    feed.feed(*eng.batch(BlockRemoved(HASHER.hashes(a)[3:])), 0.0)
    assert cached(idx, a)[0] == 3 and cached(idx, b)[0] == 5
    feed.feed(*eng.batch(AllBlocksCleared()), 0.0)
    assert cached(idx, a) == (0, 0.0) and idx.used_blocks("e") == 0
    assert feed.stored_blocks == 8 and feed.removed_blocks == 3 and feed.hash_checks == 1
    assert feed.hash_mismatches == 0 and feed.block_size == BS
    idx.check()


def test_other_media_and_groups_are_ignored() -> None:
    idx, feed, eng = setup()
    e = stored(tokens(2))
    cpu = BlockStored(e.block_hashes, None, e.token_ids, BS, medium="CPU")
    grp = BlockStored(e.block_hashes, None, e.token_ids, BS, group_idx=1)
    feed.feed(*eng.batch(cpu, grp), 0.0)
    assert idx.used_blocks("e") == 0


def test_restart_clears() -> None:
    idx, feed, eng = setup()
    feed.feed(*eng.batch(stored(tokens(3))), 0.0)
    fresh = Engine()
    fresh.ts = 5000.0  # a new process: seq from 0, later timestamps
    r = feed.feed(*fresh.batch(stored(tokens(1, 50))), 1.0)
    assert r.restarted
    assert cached(idx, tokens(3))[0] == 0 and cached(idx, tokens(1, 50))[0] == 1
    feed.restart(2.0)  # told by other means (a new epoch)
    assert idx.used_blocks("e") == 0 and feed.next_seq == 0


def test_gap_demotes_until_the_replay_fills_it() -> None:
    idx, feed, eng = setup(gap_trust=0.5)
    a = tokens(4)
    feed.feed(*eng.batch(stored(a)), 0.0)
    lost = eng.batch(stored(tokens(2, 40)))
    r = feed.feed(*eng.batch(stored(tokens(1, 80))), 0.0)
    assert r.replay_from == lost[0]
    assert cached(idx, a) == (4, 2.0)  # trust halved while the gap is open
    feed.feed(*lost, 0.0)  # the replay answer
    assert not feed.gap_open and cached(idx, a) == (4, 4.0)
    assert cached(idx, tokens(1, 80))[0] == 1 and not feed.end_replay(0.0)


def test_gap_given_up_clears_never_over_reports() -> None:
    idx, feed, eng = setup()
    a = tokens(4)
    feed.feed(*eng.batch(stored(a)), 0.0)
    eng.batch(BlockRemoved(HASHER.hashes(a)))  # lost: a removal we never see
    feed.feed(*eng.batch(stored(tokens(1, 80))), 0.0)
    assert feed.end_replay(0.0)
    assert cached(idx, a)[0] == 0  # not a ghost
    assert cached(idx, tokens(1, 80)) == (1, 1.0)  # the held batch applied, full trust
    assert feed.lost_gaps == 1


def test_late_start_catches_up_from_zero() -> None:
    idx, feed, eng = setup()
    first = eng.batch(stored(tokens(2)))
    r = feed.feed(*eng.batch(stored(tokens(1, 50))), 0.0)
    assert r.replay_from == 0
    feed.feed(*first, 0.0)
    assert cached(idx, tokens(2))[0] == 2 and not feed.gap_open


def test_silence_after_routing_demotes_then_clears() -> None:
    idx, feed, eng = setup(silent_after_s=10.0, silent_trust=0.5, silent_clear_s=30.0)
    a = tokens(3)
    feed.feed(*eng.batch(stored(a)), 0.0)
    feed.tick(100.0)
    assert cached(idx, a, 100.0) == (3, 3.0)  # idle and nothing expected: no silence
    idx.record("e", HASHER.hashes(tokens(3, 60)), 100.0)  # we routed a new prompt there
    feed.tick(105.0)
    assert not feed.silent
    feed.tick(111.0)
    assert feed.silent and cached(idx, a, 111.0) == (3, 1.5)
    # The stream comes back: full trust again.
    feed.feed(*eng.batch(stored(tokens(3, 60))), 112.0)
    assert not feed.silent and cached(idx, a, 112.0) == (3, 3.0)
    # Silent for good: demoted, then cleared.
    idx.record("e", HASHER.hashes(tokens(2, 200)), 120.0)
    feed.tick(131.0)
    assert feed.silent
    feed.tick(162.0)
    assert not feed.silent and idx.used_blocks("e") == 0 and feed.silences == 2


def test_a_batch_after_the_record_is_not_silence() -> None:
    idx, feed, eng = setup(silent_after_s=1.0)
    idx.record("e", HASHER.hashes(tokens(2)), 0.0)
    feed.feed(*eng.batch(stored(tokens(2))), 0.5)
    feed.tick(5.0)
    assert not feed.silent and idx.expecting_since("e") is None


@pytest.mark.parametrize(
    "engine", [VllmBlockHasher("sha256", BS), VllmBlockHasher("sha256_cbor", BS, seed="7")]
)
def test_wrong_algorithm_or_seed_is_detected(engine: VllmBlockHasher) -> None:
    _idx, feed, eng = setup()
    toks = tokens(2)
    feed.feed(*eng.batch(BlockStored(engine.hashes(toks), None, toks, BS)), 0.0)
    assert feed.hash_checks == 1 and feed.hash_mismatches == 1


def test_wrong_block_size_is_detected() -> None:
    _idx, feed, eng = setup()
    toks = tokens(2)
    other = VllmBlockHasher("sha256_cbor", 2 * BS)
    feed.feed(*eng.batch(BlockStored(other.hashes(toks), None, toks, 2 * BS)), 0.0)
    assert feed.hash_mismatches == 1 and feed.block_size == 2 * BS


def test_orphan_store_is_counted_not_guessed() -> None:
    idx, feed, eng = setup()
    feed.feed(*eng.batch(BlockStored([77], 12345, tokens(1), BS)), 0.0)
    assert feed.orphan_stores == 1 and idx.used_blocks("e") == 0
