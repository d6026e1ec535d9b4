"""PrefixIndex: longest-prefix match, block-level LRU with tail-first eviction, TTL,
precise stores/removals, trust, epochs; checked against a brute-force reference model."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.hotpath import block_hashes
from filters.prefix_index import PrefixIndex

M64 = 0xFFFFFFFFFFFFFFFF


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def chain(blocks: Sequence[int], seed: int = 1) -> list[int]:
    """Chained hashes of block contents (each hash determines its whole prefix)."""
    out = []
    h = seed
    for b in blocks:
        h = _mix(h ^ _mix(b + 1))
        out.append(h)
    return out


class RefLRU:
    """Block-level reference: a record stamps every block with (seq, -position), so the
    root is the most recent; eviction takes the minimum stamp; TTL drops old touches."""

    def __init__(self, capacity: int, ttl: float) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self.seq = 0
        self.blocks: dict[int, tuple[int, int, float]] = {}

    def record(self, hashes: Sequence[int], now: float) -> None:
        self.seq += 1
        for pos, h in enumerate(hashes):
            self.blocks[h] = (self.seq, -pos, now)
        self.evict()

    def evict(self) -> None:
        while len(self.blocks) > self.capacity:
            victim = min(self.blocks, key=lambda h: self.blocks[h][:2])
            del self.blocks[victim]

    def expire(self, now: float) -> None:
        for h in [h for h, (_, _, t) in self.blocks.items() if t <= now - self.ttl]:
            del self.blocks[h]


def brute_match(held: dict[str, set[int]], hashes: Sequence[int]) -> dict[str, int]:
    out = {}
    for name, blocks in held.items():
        k = 0
        for h in hashes:
            if h not in blocks:
                break
            k += 1
        if k:
            out[name] = k
    return out


# -- basics ---------------------------------------------------------------------------------


def test_longest_prefix_match_per_endpoint():
    idx = PrefixIndex()
    a = chain([1, 2, 3, 4, 5])
    b = chain([1, 2, 3, 9, 9])
    idx.record("e1", a, 0.0)
    idx.record("e2", a[:2], 0.0)
    assert idx.match(a, 1.0) == {"e1": 5, "e2": 2}
    assert idx.match(b, 1.0) == {"e1": 3, "e2": 2}
    assert idx.match(chain([7, 1, 2]), 1.0) == {}
    assert idx.match([], 1.0) == {}
    idx.check()


def test_match_stops_at_first_miss_even_when_later_blocks_are_known():
    idx = PrefixIndex()
    a = chain([1, 2, 3, 4])
    idx.record("e1", a, 0.0)
    other = chain([5, 2, 3, 4])  # different first block: different chain entirely
    assert idx.match(other, 0.0) == {}


def test_real_block_hashes_share_their_prefix():
    idx = PrefixIndex()
    system = "You are a careful assistant. " * 40
    h1 = block_hashes(system + "First question?", "m")
    h2 = block_hashes(system + "Second, different question?", "m")
    idx.record("e1", h1, 0.0)
    shared = len(system.encode()) // 64
    assert idx.match(h2, 0.0)["e1"] == shared
    assert idx.match(block_hashes(system, "other-model"), 0.0) == {}


def test_tail_first_lru_eviction():
    idx = PrefixIndex(default_capacity_blocks=6)
    a = chain([1, 2, 3, 4])
    b = chain([5, 6, 7, 8])
    idx.record("e", a, 0.0)
    idx.record("e", b, 1.0)
    # a is older: its tail goes first, its first two blocks stay.
    assert idx.held("e") == set(a[:2]) | set(b)
    assert idx.match(a, 2.0) == {"e": 2}
    assert idx.used_blocks("e") == 6
    idx.check()


def test_refreshing_a_shared_prefix_protects_it():
    idx = PrefixIndex(default_capacity_blocks=6)
    shared = [1, 2, 3]
    a = chain([*shared, 10])
    b = chain([*shared, 20])
    c = chain([30, 31])
    idx.record("e", a, 0.0)
    idx.record("e", b, 1.0)  # touches the shared 3 blocks again
    idx.record("e", c, 2.0)  # needs one block: a's tail, the least recent
    assert idx.held("e") == set(b) | set(c)
    idx.check()


def test_record_longer_than_capacity_keeps_its_head():
    idx = PrefixIndex(default_capacity_blocks=5)
    a = chain(range(8))
    idx.record("e", a, 0.0)
    assert idx.held("e") == set(a[:5])
    assert idx.match(a, 0.0) == {"e": 5}
    idx.check()


def test_capacity_zero_and_shrinking_capacity():
    idx = PrefixIndex()
    idx.set_capacity("z", 0)
    idx.record("z", chain([1, 2]), 0.0)
    assert idx.used_blocks("z") == 0
    a = chain(range(10))
    idx.record("e", a, 0.0)
    idx.set_capacity("e", 3)
    assert idx.held("e") == set(a[:3])
    idx.check()


def test_ttl_expiry_with_fake_clock():
    idx = PrefixIndex(ttl_s=10.0)
    a = chain([1, 2, 3])
    b = chain([1, 2, 4])
    idx.record("e", a, 0.0)
    idx.record("e", b[:2], 6.0)  # refreshes the shared two blocks only
    assert idx.match(a, 9.9) == {"e": 3}
    assert idx.match(a, 10.0) == {"e": 2}  # a's tail is 10 s old: gone
    assert idx.match(a, 16.0) == {}
    assert idx.used_blocks("e") == 0
    idx.check()


def test_default_has_no_age_limit_only_capacity_evicts():
    # vLLM frees cached blocks when it needs the memory, not by age: a prefix reused an
    # hour later is still there unless newer blocks pushed it out.
    idx = PrefixIndex(default_capacity_blocks=6)
    a = chain([1, 2, 3])
    idx.record("e", a, 0.0)
    idx.expire(3600.0)
    assert idx.match(a, 3600.0) == {"e": 3}
    idx.record("e", chain([7, 8, 9, 10]), 3601.0)  # 7 blocks > 6: a's tail goes
    assert idx.match(a, 3602.0) == {"e": 2}
    # Nothing is ever due, so records queue no expiry work.
    for t in range(100):
        idx.record("e", a, 3603.0 + t)
    assert len(idx._due) == 0
    idx.check()


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan")])
def test_ttl_must_be_positive(ttl: float):
    with pytest.raises(ValueError):
        PrefixIndex(ttl_s=ttl)


def test_time_never_runs_backwards_inside_the_index():
    idx = PrefixIndex(ttl_s=10.0)
    a = chain([1, 2])
    idx.record("e", a, 100.0)
    idx.record("e", chain([3]), 50.0)  # a late caller: treated as now=100
    assert idx.match(a, 105.0) == {"e": 2}


def test_approximate_vs_precise_confidence_and_trust():
    idx = PrefixIndex(approx_confidence=0.5, track_blocks=True)
    a = chain(range(10))
    idx.store("e", a[:4], 0.0)
    idx.record("e", a, 0.0)
    blocks, expected = idx.match_detail(a, 0.0)["e"]
    assert blocks == 10
    assert expected == pytest.approx(4 + 6 * 0.5)
    idx.demote("e", 0.5)
    assert idx.match_detail(a, 0.0)["e"][1] == pytest.approx((4 + 3) * 0.5)
    idx.restore("e")
    assert idx.trust("e") == 1.0


def test_demote_below_min_trust_drops_everything():
    idx = PrefixIndex(min_trust=0.1)
    idx.record("e", chain([1, 2]), 0.0)
    idx.demote("e", 0.2)
    assert idx.match(chain([1, 2]), 0.0) == {"e": 2}
    idx.demote("e", 0.2)  # 0.04 < 0.1
    assert idx.match(chain([1, 2]), 0.0) == {}
    assert idx.trust("e") == 1.0  # fresh start after the clear


def test_precise_entries_do_not_expire_and_survive_approximate_records():
    idx = PrefixIndex(ttl_s=5.0, track_blocks=True)
    a = chain(range(6))
    idx.store("e", a[:3], 0.0)
    idx.record("e", a, 0.0)  # approximate over precise: stays precise
    assert idx.match(a, 100.0) == {"e": 3}
    idx.check()


def test_store_with_parent_and_gaps():
    idx = PrefixIndex(track_blocks=True)
    a = chain(range(8))
    assert idx.store("e", a[:4], 0.0)
    # A BlockStored continuing mid-node (a new request shared only 2 blocks).
    b = chain([0, 1, 50, 51])
    assert idx.store("e", b[2:], 0.0, parent=b[1])
    assert idx.match(b, 0.0) == {"e": 4}
    assert idx.match(a, 0.0) == {"e": 4}
    # A parent nobody is known to hold: nothing changes.
    assert not idx.store("e", [123], 0.0, parent=999)
    assert not idx.store("g", [123], 0.0, parent=999)
    assert idx.used_blocks("g") == 0
    idx.check()


def test_store_with_parent_adopts_the_prefix_as_precise():
    """A BlockStored with a parent means the engine held the whole prefix to compute it:
    known from another endpoint or from our own speculation, it becomes precise here."""
    idx = PrefixIndex(track_blocks=True, ttl_s=10.0, approx_confidence=0.5)
    sys_prompt = chain(range(6))
    turn = chain([*range(6), 70, 71])
    idx.store("a", sys_prompt, 0.0)  # a stored it while we listened; f before we did
    assert idx.store("f", turn[6:], 1.0, parent=turn[5])
    assert idx.match_detail(turn, 1.0)["f"] == (8, 8.0)
    # Our own approximate record of a prefix becomes precise (and stops expiring).
    other = chain([5, 5, 5, 5])
    idx.record("g", other, 0.0)
    assert idx.match_detail(other, 0.0)["g"] == (4, 2.0)
    assert idx.store("g", [777], 2.0, parent=other[-1])
    assert idx.match([*other, 777], 100.0) == {"g": 5}
    idx.check()


def test_remove_cascades_to_descendants():
    idx = PrefixIndex(track_blocks=True)
    a = chain(range(6))
    b = chain([0, 1, 2, 9, 9])
    idx.store("e", a, 0.0)
    idx.store("e", b[3:], 0.0, parent=b[2])
    idx.store("f", a, 0.0)
    idx.remove("e", [a[2]], 0.0)
    # Everything below a[2] on e is unreachable (vLLM stops at the first miss).
    assert idx.held("e") == set(a[:2])
    assert idx.match(a, 0.0) == {"e": 2, "f": 6}
    idx.remove("e", [12345], 0.0)  # unknown: ignored
    idx.check()


def test_remove_and_parent_need_block_tracking():
    idx = PrefixIndex()
    with pytest.raises(RuntimeError):
        idx.remove("e", [1], 0.0)
    with pytest.raises(RuntimeError):
        idx.store("e", [2], 0.0, parent=1)


def test_truncate_cuts_a_ghost_chain():
    idx = PrefixIndex()
    a = chain(range(10))
    idx.record("e", a, 0.0)
    idx.record("f", a, 0.0)
    idx.truncate("e", a, 3)
    assert idx.match(a, 0.0) == {"e": 3, "f": 10}
    idx.truncate("e", a, 0)
    assert idx.match(a, 0.0) == {"f": 10}
    idx.truncate("nobody", a, 0)
    idx.check()


def test_clear_epoch_and_forget():
    idx = PrefixIndex()
    a = chain(range(4))
    idx.record("e", a, 0.0)
    idx.record("f", a, 0.0)
    assert not idx.observe_epoch("e", "boot-1")
    assert not idx.observe_epoch("e", "boot-1")
    assert idx.observe_epoch("e", "boot-2")  # restarted: its cache is empty
    assert idx.match(a, 0.0) == {"f": 4}
    idx.record("e", a, 0.0)
    idx.clear("e")
    assert idx.match(a, 0.0) == {"f": 4}
    idx.forget("f")
    assert idx.match(a, 0.0) == {}
    assert idx.node_count() == 0
    idx.record("g", a, 0.0)  # reuses the freed bit
    assert idx.match(a, 0.0) == {"g": 4}
    idx.check()


def test_many_endpoints_and_long_prompts_match_the_reference():
    idx = PrefixIndex()
    docs = [chain(range(d * 10_000, d * 10_000 + 2000)) for d in range(4)]
    held: dict[str, set[int]] = {}
    for i in range(64):
        doc = docs[i % 4]
        cut = 100 + 29 * i
        idx.record(f"e{i}", doc[:cut], float(i))
        held[f"e{i}"] = set(doc[:cut])
    for doc in docs:
        assert idx.match(doc, 100.0) == brute_match(held, doc)
    idx.check()
    # One path per document, split where the endpoints' cuts differ.
    assert idx.node_count() <= 64


def test_merges_keep_paths_short():
    idx = PrefixIndex(default_capacity_blocks=1000)
    a = chain(range(100))
    idx.record("e", a, 0.0)
    idx.record("e", a[:50], 1.0)  # splits at 50
    idx.record("e", a, 2.0)  # same recency again for the whole chain: merged
    assert idx.node_count() == 1
    idx.check()


# -- properties -------------------------------------------------------------------------------

PROMPTS = st.lists(st.integers(0, 3), min_size=0, max_size=12)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.integers(0, 2), PROMPTS, st.floats(0, 4)),
        st.tuples(st.just("clear"), st.integers(0, 2)),
        st.tuples(st.just("cap"), st.integers(0, 2), st.integers(0, 20)),
        st.tuples(st.just("tick"), st.floats(0, 12)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, queries=st.lists(PROMPTS, max_size=5))
def test_index_equals_block_level_lru_reference(ops, queries):
    ttl = 20.0
    idx = PrefixIndex(default_capacity_blocks=16, ttl_s=ttl)
    refs = {f"e{i}": RefLRU(16, ttl) for i in range(3)}
    now = 0.0
    for op in ops:
        if op[0] == "record":
            _, e, blocks, dt = op
            now += dt
            hashes = chain(blocks)
            idx.record(f"e{e}", hashes, now)
            refs[f"e{e}"].record(hashes, now)
        elif op[0] == "clear":
            idx.clear(f"e{op[1]}")
            refs[f"e{op[1]}"].blocks.clear()
        elif op[0] == "cap":
            idx.set_capacity(f"e{op[1]}", op[2])
            refs[f"e{op[1]}"].capacity = op[2]
            refs[f"e{op[1]}"].evict()
        else:
            now += op[1]
        idx.expire(now)
        for r in refs.values():
            r.expire(now)
        idx.check()
        for name, r in refs.items():
            assert idx.held(name) == set(r.blocks), name
            assert idx.used_blocks(name) <= idx.capacity(name)
    held = {name: set(r.blocks) for name, r in refs.items()}
    for q in queries:
        hashes = chain(q)
        assert idx.match(hashes, now) == brute_match(held, hashes)


@settings(max_examples=100, deadline=None)
@given(
    stores=st.lists(st.tuples(st.integers(0, 1), PROMPTS, st.booleans()), max_size=15),
    removals=st.lists(st.tuples(st.integers(0, 1), PROMPTS, st.integers(0, 11)), max_size=6),
    query=PROMPTS,
)
def test_precise_mix_keeps_invariants_and_match_is_exact(stores, removals, query):
    idx = PrefixIndex(default_capacity_blocks=12, track_blocks=True)
    for e, blocks, precise in stores:
        if precise:
            idx.store(f"e{e}", chain(blocks), 0.0)
        else:
            idx.record(f"e{e}", chain(blocks), 0.0)
        idx.check()
    for e, blocks, k in removals:
        hashes = chain(blocks)
        if k < len(hashes):
            idx.remove(f"e{e}", [hashes[k]], 0.0)
        idx.check()
    held = {name: idx.held(name) for name in idx.endpoints()}
    hashes = chain(query)
    assert idx.match(hashes, 0.0) == brute_match(held, hashes)
    for name, (blocks, expected) in idx.match_detail(hashes, 0.0).items():
        assert 0.0 <= expected <= blocks
        assert blocks <= len(hashes)
        assert name in held


def test_steady_traffic_expires_incrementally():
    idx = PrefixIndex(ttl_s=10.0)
    docs = [chain(range(d * 100, d * 100 + 50)) for d in range(8)]
    for k in range(2000):  # 100 s of traffic at 20 records/s over 16 endpoints
        now = k * 0.05
        idx.record(f"e{k % 16}", docs[k % 8][: 10 + k % 40], now)
        idx.match(docs[(k * 3) % 8], now)
    assert len(idx._due) <= 16  # one due time per holder, not one per record
    for name in idx.endpoints():  # nothing older than the TTL survives a match
        for _, at, _ in idx._holders[name].entries.values():
            assert at > 100.0 - 0.05 - 10.0, (name, at)
    idx.check()
