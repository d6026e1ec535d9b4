"""The simulated GPU KV cache: a fixed pool of blocks with a prefix cache and LRU eviction.

Modelled on vLLM v1's BlockPool and FreeKVCacheBlockQueue (vllm/v1/core/block_pool.py,
vllm/v1/core/kv_cache_utils.py): a block holds `block_size` tokens; a full block gets a
chained hash and stays findable after its request ends, on the free queue, until the
allocator needs it; the free queue evicts least recently freed first, and a request frees
its blocks tail first so a prefix outlives its continuation. Sans-I/O: it records
KV events (kv_events.BlockStored / BlockRemoved / AllBlocksCleared) for the caller.

Block hashes follow vLLM's `sha256_cbor` algorithm (vllm/utils/hashing.py and
vllm/v1/core/kv_cache_utils.py: hash_block_tokens): block i's hash is
sha256(CBOR([parent_hash_32_bytes, [token ids], extra_keys])) with CBOR in canonical
form, block 0's parent is NONE_HASH = sha256(CBOR(seed string)) (vLLM takes the seed from
PYTHONHASHSEED), and extra_keys is null here (no LoRA, multimodal input or cache salt).
KV events publish the low 64 bits of each hash, `int.from_bytes(digest, "big") & 2**64-1`,
as vLLM does with integer block hashes. With the same token ids and seed a real vLLM
started with `--prefix-caching-hash-algo sha256_cbor` computes the same hashes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from loadtest.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_MASK64: Final = (1 << 64) - 1
_CBOR_NULL: Final = b"\xf6"


def cbor_uint(value: int, major: int = 0) -> bytes:
    """Canonical CBOR head for an unsigned integer (RFC 8949, section 3)."""
    m = major << 5
    if value < 24:
        return bytes((m | value,))
    if value < 0x100:
        return bytes((m | 24, value))
    if value < 0x10000:
        return bytes((m | 25,)) + value.to_bytes(2, "big")
    if value < 0x100000000:
        return bytes((m | 26,)) + value.to_bytes(4, "big")
    return bytes((m | 27,)) + value.to_bytes(8, "big")


# Token ids repeat within and across prompts; their encodings are memoised.
_UINT_CACHE: dict[int, bytes] = {}


def _cbor_token(t: int) -> bytes:
    enc = _UINT_CACHE.get(t)
    if enc is None:
        if t < 0:
            raise ValueError("token ids are non-negative")
        enc = cbor_uint(t)
        if len(_UINT_CACHE) < 1 << 18:
            _UINT_CACHE[t] = enc
    return enc


def none_hash(seed: str = "0") -> bytes:
    """vLLM's NONE_HASH for sha256_cbor: sha256 of the CBOR text string `seed`."""
    raw = seed.encode("utf-8")
    return hashlib.sha256(cbor_uint(len(raw), 3) + raw).digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256(CBOR([parent, token_ids, null])), canonical CBOR."""
    body = b"".join([_cbor_token(t) for t in token_ids])
    data = (
        b"\x83"
        + cbor_uint(len(parent), 2)
        + parent
        + cbor_uint(len(token_ids), 4)
        + body
        + _CBOR_NULL
    )
    return hashlib.sha256(data).digest()


def external_hash(block_hash: bytes) -> int:
    """The 64-bit value KV events carry for a block hash."""
    return int.from_bytes(block_hash, "big") & _MASK64


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    parent: bytes,
    start_block: int = 0,
    prior: list[bytes] | None = None,
) -> list[bytes]:
    """Hashes of every full block of `token_ids`, chained from `parent` (NONE_HASH first).

    With `prior` (the hashes of the first `start_block` blocks) only the new full blocks
    are hashed and appended to it.
    """
    out = prior if prior is not None else []
    prev = out[-1] if out else parent
    for b in range(start_block, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[b * block_size : (b + 1) * block_size])
        out.append(prev)
    return out


class BlockPool:
    """A fixed pool of KV blocks with a hash -> block prefix cache (see module docstring).

    Invariants: a block is on the free queue iff its ref count is 0; a block is in the
    hash map iff it has a hash; allocation takes blocks from the free queue's head and
    evicts their hashes (one BlockRemoved event each, as vLLM sends them).
    """

    __slots__ = (
        "_events",
        "_free",
        "_fresh",
        "_hash",
        "_ref",
        "_table",
        "block_size",
        "caching",
        "num_blocks",
    )

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        # The free queue is blocks _fresh..num_blocks-1 (never used since the start or a
        # reset, so at its head, in id order) followed by `_free`, the blocks freed since,
        # oldest first (an OrderedDict: O(1) removal of a touched block). Keeping the
        # never-used tail implicit makes an engine cost memory only for the blocks it
        # has used: a 1,000-engine virtual fleet would otherwise hold 50M entries.
        # `_ref` and `_hash` grow with `_fresh`.
        self._fresh = 0
        self._ref: list[int] = []
        self._hash: list[bytes | None] = []
        self._table: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict()
        self._events: list[KVEvent] = []

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_cached(self) -> int:
        return len(self._table)

    def usage(self) -> float:
        """Fraction of blocks held by requests; cached but free blocks count as free."""
        return 1.0 - self.num_free / self.num_blocks

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` (not yet referenced)."""
        if not self.caching:
            return []
        table = self._table
        out: list[int] = []
        for h in hashes:
            bid = table.get(h)
            if bid is None:
                break
            out.append(bid)
        return out

    def free_after_touch(self, block_ids: Sequence[int]) -> int:
        """Free blocks left if `block_ids` were referenced (free cached ones leave the queue)."""
        ref = self._ref
        return self.num_free - sum(1 for b in block_ids if ref[b] == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        ref, free = self._ref, self._free
        for b in block_ids:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, evicting cached ones LRU-first; None if fewer than n are free."""
        free = self._free
        fresh = min(n, self.num_blocks - self._fresh)
        if n - fresh > len(free):
            return None
        ref, hashes = self._ref, self._hash
        out: list[int] = []
        if fresh:
            start = self._fresh
            out.extend(range(start, start + fresh))
            self._fresh = start + fresh
            grow = start + fresh - len(ref)
            if grow > 0:
                ref.extend([0] * grow)
                hashes.extend([None] * grow)
            for b in out:
                ref[b] = 1
        for _ in range(n - fresh):
            b, _none = free.popitem(last=False)
            h = hashes[b]
            if h is not None:
                hashes[b] = None
                del self._table[h]
                self._events.append(BlockRemoved(block_hashes=[external_hash(h)]))
            ref[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; freed ones join the queue tail-first."""
        ref, free = self._ref, self._free
        for b in reversed(block_ids):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        first: int,
        last: int,
    ) -> None:
        """Give blocks first..last-1 of a request their hashes; one BlockStored for the run.

        A hash already cached on another block (two requests computed the same prefix at
        once) stays on that block; the duplicate block stays uncached and unannounced
        (vLLM keeps both under one hash; either way the prefix stays findable).
        """
        if not self.caching or first >= last:
            return
        table, own = self._table, self._hash
        run: list[int] = []
        run_start = first
        for i in range(first, last):
            h = hashes[i]
            b = block_ids[i]
            if h in table or own[b] is not None:
                self._emit_stored(run, run_start, hashes, token_ids)
                run = []
                run_start = i + 1
                continue
            own[b] = h
            table[h] = b
            run.append(i)
        self._emit_stored(run, run_start, hashes, token_ids)

    def _emit_stored(
        self, run: list[int], start: int, hashes: Sequence[bytes], token_ids: Sequence[int]
    ) -> None:
        if not run:
            return
        bs = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=[external_hash(hashes[i]) for i in run],
                parent_block_hash=external_hash(hashes[start - 1]) if start > 0 else None,
                token_ids=list(token_ids[start * bs : (run[-1] + 1) * bs]),
                block_size=bs,
            )
        )

    def reset(self) -> None:
        """Forget every cached hash (an engine restart); all blocks must be free."""
        if self.num_free != self.num_blocks:
            raise RuntimeError("reset with blocks still referenced")
        self._table.clear()
        self._hash = [None] * len(self._hash)
        self._free = OrderedDict()
        self._fresh = 0
        self._events.append(AllBlocksCleared())
