"""The simulated KV cache: chained sha256_cbor block hashes, LRU eviction, KV events."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtest.engine.blocks import (
    BlockPool,
    cbor_uint,
    chain_hashes,
    external_hash,
    hash_block,
    none_hash,
)
from loadtest.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


@pytest.mark.parametrize(
    ("value", "encoded"),
    [  # RFC 8949 appendix A
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (100, "1864"),
        (1000, "1903e8"),
        (1000000, "1a000f4240"),
        (1000000000000, "1b000000e8d4a51000"),
    ],
)
def test_cbor_unsigned_integers_match_rfc_8949(value: int, encoded: str) -> None:
    assert cbor_uint(value).hex() == encoded


def test_block_hash_is_sha256_of_canonical_cbor_triple() -> None:
    parent = bytes(range(32))
    expected_cbor = (
        b"\x83"  # array(3)
        + b"\x58\x20"
        + parent  # bytes(32)
        + b"\x83"
        + b"\x01"
        + b"\x18\x64"
        + b"\x19\x03\xe8"  # [1, 100, 1000]
        + b"\xf6"  # null extra_keys
    )
    assert hash_block(parent, [1, 100, 1000]) == hashlib.sha256(expected_cbor).digest()
    # NONE_HASH: sha256 of the CBOR text string "0" (PYTHONHASHSEED=0 in vLLM).
    assert none_hash("0") == hashlib.sha256(b"\x61" + b"0").digest()


@given(st.lists(st.integers(0, 200_000), min_size=0, max_size=100), st.integers(1, 20))
def test_hash_chain_depends_on_every_earlier_block(tokens: list[int], bs: int) -> None:
    root = none_hash()
    hashes = chain_hashes(tokens, bs, root)
    assert len(hashes) == len(tokens) // bs
    prev = root
    for i, h in enumerate(hashes):
        assert h == hash_block(prev, tokens[i * bs : (i + 1) * bs])
        prev = h
    # Appending tokens only adds hashes; it never changes earlier ones.
    more = chain_hashes(tokens + [7] * bs, bs, root)
    assert more[: len(hashes)] == hashes
    incremental = chain_hashes(tokens + [7] * bs, bs, root, len(hashes), list(hashes))
    assert incremental == more


def test_same_block_under_a_different_prefix_hashes_differently() -> None:
    root = none_hash()
    a = chain_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4, root)
    b = chain_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4, root)
    assert a[1] != b[1]
    assert external_hash(a[0]) == int.from_bytes(a[0], "big") & (2**64 - 1)


def _store(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    hashes = chain_hashes(tokens, pool.block_size, none_hash())
    ids = pool.allocate(len(hashes))
    assert ids is not None
    pool.cache_blocks(ids, hashes, tokens, 0, len(hashes))
    return ids, hashes


def test_prompt_blocks_are_stored_as_one_event_with_their_parent() -> None:
    pool = BlockPool(8, 4)
    tokens = list(range(12))
    ids, hashes = _store(pool, tokens)
    events = pool.take_events()
    assert events == [
        BlockStored(
            block_hashes=[external_hash(h) for h in hashes],
            parent_block_hash=None,
            token_ids=tokens,
            block_size=4,
        )
    ]
    more = [*tokens, 50, 51, 52, 53]
    hashes = chain_hashes(more, 4, none_hash(), 3, list(hashes))
    extra = pool.allocate(1)
    assert extra is not None
    pool.cache_blocks(ids + extra, hashes, more, 3, 4)
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash == external_hash(hashes[2])
    assert ev.token_ids == [50, 51, 52, 53]


def test_cached_prefix_survives_free_and_is_found_again() -> None:
    pool = BlockPool(8, 4)
    ids, hashes = _store(pool, list(range(12)))
    pool.free(ids)
    assert pool.usage() == 0.0 and pool.num_cached == 3
    assert pool.cached_prefix(hashes) == ids
    other = chain_hashes([0, 1, 2, 3, 99, 99, 99, 99], 4, none_hash())
    assert pool.cached_prefix(other) == ids[:1]
    pool.touch(ids[:2])
    assert pool.usage() == 2 / 8


def test_eviction_is_lru_and_frees_a_request_tail_first() -> None:
    pool = BlockPool(6, 2)
    a_ids, a_hashes = _store(pool, [1, 1, 2, 2, 3, 3])  # 3 blocks
    b_ids, b_hashes = _store(pool, [7, 7, 8, 8, 9, 9])  # 3 blocks
    pool.take_events()
    pool.free(a_ids)  # a freed first: least recently used
    pool.free(b_ids)
    got = pool.allocate(2)
    assert got == [a_ids[2], a_ids[1]]  # a's tail goes first, its head survives longest
    removed = pool.take_events()
    assert removed == [
        BlockRemoved(block_hashes=[external_hash(a_hashes[2])]),
        BlockRemoved(block_hashes=[external_hash(a_hashes[1])]),
    ]
    assert pool.cached_prefix(a_hashes) == [a_ids[0]]
    assert pool.cached_prefix(b_hashes) == b_ids


def test_a_touched_block_is_not_evicted() -> None:
    pool = BlockPool(3, 2)
    ids, hashes = _store(pool, [1, 1, 2, 2, 3, 3])
    pool.free(ids)
    pool.touch(ids[:1])
    assert pool.free_after_touch(ids[:2]) == 1
    assert pool.allocate(3) is None
    got = pool.allocate(2)
    assert got is not None and ids[0] not in got
    assert pool.cached_prefix(hashes) == ids[:1]


def test_duplicate_hash_stays_on_the_first_block() -> None:
    pool = BlockPool(8, 2)
    ids1, hashes = _store(pool, [4, 4, 5, 5])
    pool.take_events()
    ids2 = pool.allocate(2)
    assert ids2 is not None
    pool.cache_blocks(ids2, hashes, [4, 4, 5, 5], 0, 2)
    assert pool.take_events() == []
    assert pool.cached_prefix(hashes) == ids1


def test_reset_clears_everything_and_announces_it() -> None:
    pool = BlockPool(4, 2)
    ids, hashes = _store(pool, [1, 2, 3, 4])
    with pytest.raises(RuntimeError):
        pool.reset()
    pool.free(ids)
    pool.take_events()
    pool.reset()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_prefix(hashes) == [] and pool.num_free == 4


def test_caching_off_never_stores() -> None:
    pool = BlockPool(4, 2, caching=False)
    _ids, hashes = _store(pool, [1, 2, 3, 4])
    assert pool.take_events() == [] and pool.cached_prefix(hashes) == []
