"""filters/kv_digest.py: vLLM KV event batches -> the engine's block set and its digests."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from filters.kv_digest import Digest, KVDigestTracker, KVEventError, decode_batch
from loadtest.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch


def stored(*hashes: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(list(hashes), None, [0] * 16 * len(hashes), 16, medium=medium)


def removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(list(hashes))


class Engine:
    """Batches as a vLLM engine numbers them: seq from 0, ts growing."""

    def __init__(self, fmt: str = "map") -> None:
        self.seq = 0
        self.ts = 1000.0
        self.fmt = fmt

    def batch(self, *events: object) -> tuple[int, bytes]:
        self.ts += 1
        seq, self.seq = self.seq, self.seq + 1
        return seq, encode_batch(self.ts, events, fmt=self.fmt)  # type: ignore[arg-type]


def apply(base: set[int], d: Digest) -> set[int]:
    return set(d.added) if d.full else (base - set(d.removed)) | set(d.added)


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_stored_removed_cleared(fmt: str) -> None:
    e, t = Engine(fmt), KVDigestTracker("e0", "ep1")
    t.feed(*e.batch(stored(1, 2, 3)), now=0)
    t.feed(*e.batch(removed(2), stored(4)), now=0)
    assert t.blocks == {1, 3, 4}
    t.feed(*e.batch(AllBlocksCleared(), stored(9)), now=0)
    assert t.blocks == {9}


def test_other_media_are_not_gpu_blocks() -> None:
    e, t = Engine(), KVDigestTracker("e0", "ep1")
    t.feed(*e.batch(stored(1), stored(2, medium="CPU")), now=0)
    assert t.blocks == {1}


def test_digests_full_then_cumulative_deltas() -> None:
    e, t = Engine(), KVDigestTracker("e0", "ep1", resync_s=100, min_delta_blocks=100)
    t.feed(*e.batch(stored(1, 2, 3)), now=0)
    d0 = t.digest(0)
    assert d0 is not None and d0.full and d0.added == (1, 2, 3) and d0.seq == d0.base_seq == 0
    assert t.digest(0.1) is None  # nothing changed
    t.feed(*e.batch(removed(1), stored(5)), now=0.2)
    d1 = t.digest(0.2)
    assert d1 is not None and not d1.full and d1.base_seq == 0 and d1.seq == 1
    assert (d1.added, d1.removed) == ((5,), (1,))
    # Cumulative: a subscriber that missed d1 can apply d2 to the full d0.
    t.feed(*e.batch(stored(6), removed(5)), now=0.3)
    d2 = t.digest(0.3)
    assert d2 is not None and (d2.added, d2.removed) == ((6,), (1,))
    assert apply(set(d0.added), d2) == t.blocks == {2, 3, 6}
    # A clear is a full digest with nothing in it.
    t.feed(*e.batch(AllBlocksCleared()), now=0.4)
    d3 = t.digest(0.4)
    assert d3 is not None and d3.full and d3.added == () and d3.seq == 3


def test_periodic_resync_and_big_delta_go_full() -> None:
    e = Engine()
    t = KVDigestTracker("e0", "ep1", resync_s=10, min_delta_blocks=2, max_delta_fraction=0.5)
    t.digest(0)
    t.feed(*e.batch(stored(1)), now=1)
    d = t.digest(1)
    assert d is not None and not d.full
    t.feed(*e.batch(stored(2, 3, 4)), now=2)
    d = t.digest(2)
    assert d is not None and d.full  # 4 changed blocks > max(2, 0.5 * 4)
    t.feed(*e.batch(stored(5)), now=3)
    d = t.digest(11.9)
    assert d is not None and not d.full
    d = t.digest(12.1)
    assert d is not None and d.full and set(d.added) == {1, 2, 3, 4, 5}


def test_new_epoch_forces_a_full_digest_and_keeps_blocks() -> None:
    e, t = Engine(), KVDigestTracker("e0", "ep1")
    t.feed(*e.batch(stored(1)), now=0)
    t.digest(0)
    t.set_epoch("ep2")
    d = t.digest(0.1)
    assert d is not None and d.full and d.epoch == "ep2" and d.added == (1,)


def test_gap_asks_for_replay_and_replay_catches_up() -> None:
    e, t = Engine(), KVDigestTracker("e0", "ep1")
    b = [e.batch(stored(1)), e.batch(stored(2)), e.batch(removed(1)), e.batch(stored(4))]
    assert t.feed(*b[0], now=0).applied == 1
    r = t.feed(*b[3], now=1)
    assert r.replay_from == 1 and r.applied == 0 and t.gap_open
    assert t.blocks == {1}  # held, not applied out of order
    # The replay answer: seq >= 1, including one we hold already.
    assert t.feed(*b[1], now=1).applied == 1
    assert t.feed(*b[2], now=1).applied == 2  # fills the gap, then the held batch
    assert t.feed(*b[3], now=1).duplicate
    assert not t.end_replay()
    assert t.blocks == {2, 4} and t.next_seq == 4 and t.lost_gaps == 0


def test_gap_replay_cannot_fill_clears_the_set() -> None:
    e, t = Engine(), KVDigestTracker("e0", "ep1")
    t.feed(*e.batch(stored(1)), now=0)
    e.batch(removed(1))  # lost, and gone from the engine's replay buffer
    t.feed(*e.batch(stored(3)), now=0)
    assert t.end_replay()
    # Under-report rather than keep block 1, whose removal we missed.
    assert t.blocks == {3} and t.lost_gaps == 1 and not t.gap_open
    d = t.digest(1)
    assert d is not None and d.full and d.added == (3,)


def test_catch_up_from_zero_when_started_after_the_engine() -> None:
    e, t = Engine(), KVDigestTracker("e0", "ep1")
    early = [e.batch(stored(1)), e.batch(stored(2))]
    r = t.feed(*e.batch(stored(3)), now=0)
    assert r.replay_from == 0
    for b in early:
        t.feed(*b, now=0)
    assert t.blocks == {1, 2, 3}
    late = KVDigestTracker("e0", "ep1", catch_up=False)
    assert late.feed(*e.batch(stored(7)), now=0).applied == 1


def test_duplicates_and_out_of_order_are_harmless() -> None:
    e, t = Engine(), KVDigestTracker("e0", "ep1")
    b0, b1, b2 = e.batch(stored(1)), e.batch(removed(1)), e.batch(stored(1, 2))
    t.feed(*b0, now=0)
    t.feed(*b2, now=0)
    t.feed(*b2, now=0)  # held twice
    t.feed(*b1, now=0)
    t.feed(*b0, now=0)  # already applied
    assert t.blocks == {1, 2} and t.duplicates == 2


def test_restart_seq_back_to_zero_clears() -> None:
    e, t = Engine(), KVDigestTracker("e0", "ep1")
    for _ in range(5):
        t.feed(*e.batch(stored(e.seq + 100)), now=0)
    t.digest(0)
    fresh = Engine()
    fresh.ts = e.ts + 5  # a new process, later
    r = t.feed(*fresh.batch(stored(7)), now=1)
    assert r.restarted and t.blocks == {7} and t.next_seq == 1
    d = t.digest(1)
    assert d is not None and d.full and d.added == (7,)
    t.feed(*fresh.batch(stored(8)), now=1)
    t.feed(*fresh.batch(stored(9)), now=1)
    # A restart whose first batches were lost asks for them from 0.
    again = Engine()
    again.ts = fresh.ts + 5
    again.batch(stored(8))
    r = t.feed(*again.batch(stored(9)), now=2)
    assert r.restarted and r.replay_from == 0


def test_block_size_follows_the_engine() -> None:
    t = KVDigestTracker("e0", "ep1", block_size=16)
    t.feed(0, encode_batch(1.0, [BlockStored([5], None, [0] * 32, 32)]), now=0)
    d = t.digest(0)
    assert d is not None and d.block_size == 32


def test_real_vllm_shaped_payload() -> None:
    # As observed from vLLM 0.32 (notes/real-vllm-on-cpu.md): extra keys, unknown events.
    payload = msgpack.packb(
        [
            1.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [2**64 - 1, 12],
                    "parent_block_hash": None,
                    "token_ids": list(range(64)),
                    "block_size": 32,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None, None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                },
                {"type": "SomethingNew", "x": 1},
            ],
            0,
        ]
    )
    ts, events = decode_batch(payload)
    assert ts == 1.5 and len(events) == 1


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1])])
def test_bad_payloads_raise_kv_event_error(payload: bytes) -> None:
    with pytest.raises(KVEventError):
        KVDigestTracker("e0", "ep1").feed(0, payload, now=0)


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_kv_event_error(payload: bytes) -> None:
    with contextlib.suppress(KVEventError):
        decode_batch(payload)


@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 20), min_size=1, max_size=4)),
        max_size=30,
    ),
    st.randoms(use_true_random=False),
)
def test_any_delivery_order_gives_the_same_set(
    ops: list[tuple[bool, list[int]]], rnd: object
) -> None:
    import random

    assert isinstance(rnd, random.Random)
    e = Engine()
    batches = [e.batch(stored(*hs) if add else removed(*hs)) for add, hs in ops]
    in_order = KVDigestTracker("e0", "ep1")
    for b in batches:
        in_order.feed(*b, now=0)
    shuffled = batches + rnd.sample(batches, k=len(batches) // 2)  # with duplicates
    rnd.shuffle(shuffled)
    t = KVDigestTracker("e0", "ep1")
    base: set[int] = set()
    for b in shuffled:
        t.feed(*b, now=0)
        d = t.digest(0)
        if d is not None:
            base = apply(base, d) if not d.full else set(d.added)
    assert not t.gap_open
    assert t.blocks == in_order.blocks
