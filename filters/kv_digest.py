"""An engine's cached KV blocks, rebuilt from its KV event batches (vLLM's wire format): the
set behind the `PrefixDigest` deltas and resyncs the agent publishes (`KVDigestTracker`),
and the precise entries of a `PrefixIndex` a router matches requests against
(`KVIndexFeed`). Both order batches the same way (`KVSequencer`).

Sans-I/O: the I/O side (meshd/kv_events.py, meshd/agent.py) receives `[topic, seq,
payload]` from the engine's ZMQ PUB socket and feeds `(seq, payload)` here with `now`; it
asks the replay socket for the batches `feed` says are missing. Wire format: vllm-project/
vllm, vllm/distributed/kv_events.py (`EventBatch` = msgpack `[ts, [events], dp_rank]`;
events are maps tagged by "type", or arrays `["BlockStored", ...]` in older releases);
observed on a real vLLM in /work/shared/notes/real-vllm-on-cpu.md and captured in
tests/golden/vllm_kv_events_*.json.

Guarantee: after a loss the set (or index) may under-report (forget blocks the engine still
has), never over-report (claim blocks it may have evicted): a gap the replay socket cannot
fill clears it, because a missed BlockRemoved would otherwise leave a block in it forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from filters.prefix_index import PrefixIndex
from filters.vllm_blocks import VllmBlockHasher

__all__ = [
    "MAX_PENDING_BATCHES",
    "REPLAY_END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Digest",
    "FeedResult",
    "KVDigestTracker",
    "KVEvent",
    "KVEventError",
    "KVIndexFeed",
    "KVSequencer",
    "decode_batch",
    "parse_pub_frames",
    "parse_replay_frames",
]

# Batches held while a gap before them is being replayed; beyond this the gap is given up.
MAX_PENDING_BATCHES = 4096
# Tiers that hold blocks an engine can serve a prefix hit from without a transfer.
GPU_MEDIA = frozenset({None, "GPU", "gpu"})
# vLLM's replay socket ends an answer with this seq and an empty payload.
REPLAY_END_SEQ = 0xFFFFFFFFFFFFFFFF


class KVEventError(ValueError):
    """A payload that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """`parent_block_hash` None: the run starts at the root. `token_ids` cover the run's
    blocks (block_size each); `extra_keys` has one entry per block (vLLM's untagged form:
    None, or a list of the LoRA name, mm pairs, the cache salt...)."""

    block_hashes: tuple[int, ...]
    block_size: int | None
    medium: str | None = "GPU"
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = "GPU"
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _hash(h: Any) -> int:
    if isinstance(h, bytes):
        # vLLM releases before the int64 change (and VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
        # publish raw digests; the low 64 bits are what the int form carries.
        return int.from_bytes(h[-8:], "big")
    if not isinstance(h, int) or isinstance(h, bool):
        raise KVEventError(f"block hash {h!r:.40} is not an integer")
    return h & 0xFFFFFFFFFFFFFFFF


def _hashes(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple):
        raise KVEventError("block_hashes: list expected")
    return tuple(_hash(h) for h in raw)


def _parent(raw: Any) -> int | None:
    return None if raw is None else _hash(raw)


def _tokens(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple):
        return ()
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise KVEventError("token_ids: integers expected")
    return tuple(raw)


def _size(raw: Any) -> int | None:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw > 0 else None


def _int(raw: Any, default: int = 0) -> int:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else default


def _str(raw: Any) -> str | None:
    return raw if isinstance(raw, str) else None


def _extra(raw: Any) -> tuple[Any, ...] | None:
    return tuple(raw) if isinstance(raw, list | tuple) else None


def _event(obj: Any) -> KVEvent | None:
    """One event, or None for an event type this module does not use."""
    if isinstance(obj, dict):
        kind = obj.get("type")
        if kind == "BlockStored":
            return BlockStored(
                _hashes(obj.get("block_hashes")),
                _size(obj.get("block_size")),
                _str(obj.get("medium", "GPU")),
                parent_block_hash=_parent(obj.get("parent_block_hash")),
                token_ids=_tokens(obj.get("token_ids")),
                lora_name=_str(obj.get("lora_name")),
                extra_keys=_extra(obj.get("extra_keys")),
                group_idx=_int(obj.get("group_idx")),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(
                _hashes(obj.get("block_hashes")),
                _str(obj.get("medium", "GPU")),
                _int(obj.get("group_idx")),
            )
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    if isinstance(obj, list | tuple) and obj:
        # Older releases: ["BlockStored", hashes, parent, token_ids, block_size, lora_id,
        # medium, lora_name?, extra_keys?, group_idx?] and ["BlockRemoved", hashes, medium].
        kind = obj[0]
        if kind == "BlockStored" and len(obj) >= 5:
            return BlockStored(
                _hashes(obj[1]),
                _size(obj[4]),
                _str(obj[6]) if len(obj) > 6 else "GPU",
                parent_block_hash=_parent(obj[2]),
                token_ids=_tokens(obj[3]),
                lora_name=_str(obj[7]) if len(obj) > 7 else None,
                extra_keys=_extra(obj[8]) if len(obj) > 8 else None,
                group_idx=_int(obj[9]) if len(obj) > 9 else 0,
            )
        if kind == "BlockRemoved" and len(obj) >= 2:
            return BlockRemoved(
                _hashes(obj[1]),
                _str(obj[2]) if len(obj) > 2 else "GPU",
                _int(obj[3]) if len(obj) > 3 else 0,
            )
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    raise KVEventError(f"not a KV event: {obj!r:.100}")


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """(ts, events) of one batch payload; KVEventError (only) when malformed."""
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise KVEventError(f"not msgpack: {exc}") from None
    if not isinstance(doc, list | tuple) or len(doc) < 2 or not isinstance(doc[1], list | tuple):
        raise KVEventError("a KV event batch is a msgpack array [ts, events, dp_rank]")
    ts = doc[0]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KVEventError("batch timestamp is not a number")
    events = [e for e in (_event(o) for o in doc[1]) if e is not None]
    return float(ts), events


def parse_pub_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of one PUB message `[topic, seq, payload]`; KVEventError when
    it is not shaped like one."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVEventError(f"a KV event message is [topic, seq(8), payload], got {len(frames)}")
    return frames[0], int.from_bytes(frames[1], "big"), frames[2]


def parse_replay_frames(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay answer `[b"", topic, seq, payload]` as a DEALER sees
    it, or None for the end marker (seq REPLAY_END_SEQ); KVEventError otherwise."""
    if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
        raise KVEventError("a replay answer is [b'', topic, seq(8), payload]")
    seq = int.from_bytes(frames[2], "big")
    return None if seq == REPLAY_END_SEQ else (seq, frames[3])


@dataclass(frozen=True, slots=True)
class Digest:
    """One digest, field for field xds.resources.PrefixDigest (which filters/ must not
    import); the agent converts it."""

    engine: str
    epoch: str
    seq: int
    base_seq: int
    full: bool
    block_size: int
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class FeedResult:
    """What one `feed` did. `replay_from`: the first missing seq, when the batch opened a
    gap (ask the replay socket from there, then call `end_replay`)."""

    applied: int = 0
    duplicate: bool = False
    restarted: bool = False
    replay_from: int | None = None


class KVSequencer:
    """Puts one engine's KV event batches in order, and says when some are missing.

    `feed(seq, payload, now)` takes batches in any order: the next expected one is applied
    (and any held ones that follow it); a later one is held and reported as a gap (its
    `replay_from` is the first missing seq); an earlier one is a duplicate, unless its
    timestamp is newer than any seen, which means a new engine process whose counter
    started again (vLLM's seq starts at 0 per process): then the state is reset.

    With `catch_up=True` a first batch after seq 0 (we started after the engine) opens a
    gap from 0, so the replay socket's buffer fills in what came before.

    Subclasses say what applying a batch means (`_apply`) and what forgetting everything
    means (`_reset`); `_gap_opened` and `_gap_closed` are told when the order breaks and
    heals.
    """

    def __init__(self, *, max_pending: int = MAX_PENDING_BATCHES, catch_up: bool = True) -> None:
        self.max_pending = max_pending
        # None: take whatever comes first (or, catching up, start from 0).
        self.next_seq: int | None = 0 if catch_up else None
        self._catch_up = catch_up
        self._last_ts = float("-inf")
        self._pending: dict[int, tuple[float, list[KVEvent]]] = {}
        self._gap_since: float | None = None
        self.last_batch_at: float | None = None
        # Counters for metrics.
        self.batches = 0
        self.duplicates = 0
        self.gaps = 0
        self.lost_gaps = 0
        self.restarts = 0
        self.bad_payloads = 0

    # -- what a subclass does ---------------------------------------------------------------

    def _apply(self, ts: float, events: Sequence[KVEvent], now: float) -> None:
        raise NotImplementedError

    def _reset(self, now: float) -> None:
        raise NotImplementedError

    def _gap_opened(self, now: float) -> None:
        """Batches are missing from `next_seq` on (replay asked for, or not possible)."""

    def _gap_closed(self, now: float) -> None:
        """The order is whole again (replay filled the gap, or it was given up)."""

    # -- ordering -----------------------------------------------------------------------------

    @property
    def gap_open(self) -> bool:
        return bool(self._pending)

    def gap_open_since(self) -> float | None:
        return self._gap_since

    def feed(self, seq: int, payload: bytes, now: float) -> FeedResult:
        """One batch as received; raises KVEventError for a malformed payload (the seq is
        then treated as lost, opening a gap the replay may fill)."""
        try:
            ts, events = decode_batch(payload)
        except KVEventError:
            self.bad_payloads += 1
            raise
        return self.feed_events(seq, ts, events, now)

    def feed_events(self, seq: int, ts: float, events: Sequence[KVEvent], now: float) -> FeedResult:
        self.last_batch_at = now
        restarted = False
        if self.next_seq is not None and seq < self.next_seq:
            if ts <= self._last_ts:
                self.duplicates += 1
                return FeedResult(duplicate=True)
            # A new engine process: its cache is empty, whatever it published before.
            restarted = True
            self.restarts += 1
            had_gap = bool(self._pending)
            self._pending.clear()
            self._gap_since = None
            self._reset(now)
            if had_gap:
                self._gap_closed(now)
            self.next_seq = 0
        if self.next_seq is None:
            self.next_seq = seq
        if seq > self.next_seq:
            if seq in self._pending:
                self.duplicates += 1
                return FeedResult(duplicate=True, restarted=restarted)
            first_gap = not self._pending
            self._pending[seq] = (ts, list(events))
            if first_gap:
                self.gaps += 1
                self._gap_since = now
                self._gap_opened(now)
            if len(self._pending) > self.max_pending:
                return FeedResult(applied=self.abandon_gap(now), restarted=restarted)
            return FeedResult(restarted=restarted, replay_from=self.next_seq if first_gap else None)
        self._apply_batch(ts, events, now)
        self.next_seq = seq + 1
        return FeedResult(applied=1 + self._drain(now), restarted=restarted)

    def _apply_batch(self, ts: float, events: Sequence[KVEvent], now: float) -> None:
        self.batches += 1
        self._last_ts = max(self._last_ts, ts)
        self._apply(ts, events, now)

    def _drain(self, now: float) -> int:
        n = 0
        had_gap = bool(self._pending)
        while self.next_seq is not None and self.next_seq in self._pending:
            ts, events = self._pending.pop(self.next_seq)
            self._apply_batch(ts, events, now)
            self.next_seq += 1
            n += 1
        # Held batches older than the next seq (replayed twice) are duplicates.
        for s in [s for s in self._pending if self.next_seq is not None and s < self.next_seq]:
            del self._pending[s]
        if not self._pending:
            self._gap_since = None
            if had_gap:
                self._gap_closed(now)
        return n

    def end_replay(self, now: float = 0.0) -> bool:
        """The replay answer has ended: give up a gap it did not fill. Returns whether one
        was given up."""
        if self._pending:
            self.abandon_gap(now)
            return True
        return False

    def abandon_gap(self, now: float = 0.0) -> int:
        """The missing batches will not come: forget everything (see the module docstring)
        and continue from the earliest held batch. Returns the batches then applied."""
        if not self._pending:
            return 0
        self.lost_gaps += 1
        self._reset(now)
        self.next_seq = min(self._pending)
        return self._drain(now)

    def restart(self, now: float) -> None:
        """The engine restarted (seen by other means, e.g. a new epoch on /metrics): forget
        everything and expect its events from seq 0 again."""
        had_gap = bool(self._pending)
        self._pending.clear()
        self._gap_since = None
        self._last_ts = float("-inf")
        self.next_seq = 0 if self._catch_up else None
        self.restarts += 1
        self._reset(now)
        if had_gap:
            self._gap_closed(now)


class KVDigestTracker(KVSequencer):
    """The set of block hashes one engine holds, and the digests that publish it.

    Batches are ordered by KVSequencer. `digest(now)` returns the next Digest
    (xds.resources.PrefixDigest's shape) when there is something to say: full at the first
    call, after a clear, a restart or a new epoch, every `resync_s`, or when the cumulative
    delta outgrows `max_delta_fraction` of the set; cumulative otherwise.
    """

    def __init__(
        self,
        engine: str,
        epoch: str,
        *,
        block_size: int = 16,
        resync_s: float = 30.0,
        max_delta_fraction: float = 0.5,
        min_delta_blocks: int = 256,
        max_pending: int = MAX_PENDING_BATCHES,
        catch_up: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        super().__init__(max_pending=max_pending, catch_up=catch_up)
        self.engine = engine
        self.epoch = epoch
        self.block_size = block_size
        self.resync_s = resync_s
        self.max_delta_fraction = max_delta_fraction
        self.min_delta_blocks = min_delta_blocks
        self.blocks: set[int] = set()
        # Digest state: the set at the last full digest, and the changes since.
        self._base: set[int] = set()
        self._added: set[int] = set()
        self._removed: set[int] = set()
        self._seq = -1
        self._base_seq = 0
        self._need_full = True
        self._dirty = True
        self._last_full_at: float | None = None

    def _reset(self, now: float) -> None:
        self._clear()

    def _apply(self, ts: float, events: Iterable[KVEvent], now: float) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                if e.medium not in GPU_MEDIA:
                    continue
                if e.block_size is not None and e.block_size != self.block_size:
                    # The engine's own figure wins over config; a new size invalidates all.
                    self.block_size = e.block_size
                    self._need_full = True
                for h in e.block_hashes:
                    self._store(h)
            elif isinstance(e, BlockRemoved):
                if e.medium not in GPU_MEDIA:
                    continue
                for h in e.block_hashes:
                    self._remove(h)
            else:
                self._clear()

    def _store(self, h: int) -> None:
        if h in self.blocks:
            return
        self.blocks.add(h)
        self._dirty = True
        if h in self._removed:
            self._removed.discard(h)
        elif h not in self._base:
            self._added.add(h)

    def _remove(self, h: int) -> None:
        if h not in self.blocks:
            return
        self.blocks.discard(h)
        self._dirty = True
        if h in self._added:
            self._added.discard(h)
        elif h in self._base:
            self._removed.add(h)

    def _clear(self) -> None:
        self.blocks = set()
        self._need_full = True
        self._dirty = True

    # -- digests --------------------------------------------------------------------------

    def set_epoch(self, epoch: str) -> None:
        """The engine's epoch changed: the next digest is full, under the new epoch. The set
        is kept: events of the new process may already be in it (a restart that its events
        showed has cleared it already)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.force_full()

    def force_full(self) -> None:
        self._need_full = True
        self._dirty = True

    def digest(self, now: float) -> Digest | None:
        """The next digest to publish, or None when nothing changed since the last one."""
        delta = len(self._added) + len(self._removed)
        due = self._last_full_at is None or now - self._last_full_at >= self.resync_s
        big = delta > max(self.min_delta_blocks, self.max_delta_fraction * len(self.blocks))
        if self._need_full or due or big:
            self._seq += 1
            self._base_seq = self._seq
            self._base = set(self.blocks)
            self._added.clear()
            self._removed.clear()
            self._need_full = self._dirty = False
            self._last_full_at = now
            return Digest(
                engine=self.engine,
                epoch=self.epoch,
                seq=self._seq,
                base_seq=self._seq,
                full=True,
                block_size=self.block_size,
                added=tuple(sorted(self._base)),
            )
        if not self._dirty:
            return None
        self._dirty = False
        self._seq += 1
        return Digest(
            engine=self.engine,
            epoch=self.epoch,
            seq=self._seq,
            base_seq=self._base_seq,
            full=False,
            block_size=self.block_size,
            added=tuple(sorted(self._added)),
            removed=tuple(sorted(self._removed)),
        )


class KVIndexFeed(KVSequencer):
    """One engine's KV events applied to its precise entries in a PrefixIndex, whose
    block hashes are the engine's own (the request side computes them with
    filters.vllm_blocks.VllmBlockHasher). The index needs `track_blocks=True`.

    BlockStored -> `store` (with its parent), BlockRemoved -> `remove`, AllBlocksCleared ->
    `clear`; only GPU-tier events of KV cache group 0 count (a prefix hit needs the GPU
    copy; hybrid models publish one event per group for the same hashes).

    Staleness, so that routing never chases ghosts:

    * restart (seq back to 0 with a newer timestamp, or `restart(now)`): clear;
    * gap (a seq missing): trust x `gap_trust` until the replay fills it; a gap given up
      clears (never over-report);
    * silence: the index gave this endpoint new blocks (we routed requests there) and no
      batch has come for `silent_after_s`: trust x `silent_trust`, and after
      `silent_clear_s` more, clear; the next batch restores trust;
    * wrong hashes: with a `verify` hasher, a root BlockStored (no parent, no extra keys)
      is re-hashed from its token ids; a mismatch means the engine's hash algorithm, seed
      or block size is not the configured one (`hash_mismatches` counts them; the
      request side then computes hashes the engine will never publish).
    """

    def __init__(
        self,
        index: PrefixIndex,
        endpoint: str,
        *,
        verify: VllmBlockHasher | None = None,
        gap_trust: float = 0.5,
        silent_after_s: float = 10.0,
        silent_trust: float = 0.5,
        silent_clear_s: float = 60.0,
        max_pending: int = MAX_PENDING_BATCHES,
        catch_up: bool = True,
    ) -> None:
        super().__init__(max_pending=max_pending, catch_up=catch_up)
        self.index = index
        self.endpoint = endpoint
        self.verify = verify
        self.gap_trust = gap_trust
        self.silent_after_s = silent_after_s
        self.silent_trust = silent_trust
        self.silent_clear_s = silent_clear_s
        self.block_size: int | None = None  # learnt from BlockStored
        self._gap = False
        self._silent_since: float | None = None
        # Counters.
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.orphan_stores = 0  # a parent the index does not know (stored before we came)
        self.clears = 0
        self.hash_checks = 0
        self.hash_mismatches = 0
        self.silences = 0

    @property
    def silent(self) -> bool:
        return self._silent_since is not None

    def _trust(self) -> None:
        t = 1.0
        if self._gap:
            t *= self.gap_trust
        if self._silent_since is not None:
            t *= self.silent_trust
        self.index.restore(self.endpoint)
        if t < 1.0:
            self.index.demote(self.endpoint, t)

    def _gap_opened(self, now: float) -> None:
        self._gap = True
        self._trust()

    def _gap_closed(self, now: float) -> None:
        self._gap = False
        self._trust()

    def _reset(self, now: float) -> None:
        self.clears += 1
        self.index.clear(self.endpoint)
        self._trust()

    def _apply(self, ts: float, events: Sequence[KVEvent], now: float) -> None:
        index = self.index
        name = self.endpoint
        index.acknowledge(name)
        if self._silent_since is not None:
            self._silent_since = None
            self._trust()
        for e in events:
            if isinstance(e, BlockStored):
                if e.medium not in GPU_MEDIA or e.group_idx != 0 or not e.block_hashes:
                    continue
                if e.block_size is not None:
                    self.block_size = e.block_size
                if self.verify is not None and e.parent_block_hash is None:
                    self._check(e)
                if index.store(name, e.block_hashes, now, parent=e.parent_block_hash):
                    self.stored_blocks += len(e.block_hashes)
                else:
                    self.orphan_stores += 1
            elif isinstance(e, BlockRemoved):
                if e.medium not in GPU_MEDIA or e.group_idx != 0:
                    continue
                self.removed_blocks += len(e.block_hashes)
                index.remove(name, e.block_hashes, now)
            else:
                self.clears += 1
                index.clear(name)
                self._trust()

    def _check(self, e: BlockStored) -> None:
        v = self.verify
        assert v is not None
        n = len(e.block_hashes)
        if e.extra_keys and any(k is not None for k in e.extra_keys):
            return  # LoRA, salts, media: the request side knows its keys; the event does not
        if len(e.token_ids) != n * v.block_size:
            if e.block_size is not None and e.block_size != v.block_size:
                self.hash_checks += 1
                self.hash_mismatches += 1
            return
        self.hash_checks += 1
        if v.hashes(e.token_ids) != list(e.block_hashes):
            self.hash_mismatches += 1

    def tick(self, now: float) -> None:
        """Look for silence (see the class docstring); call it every second or so."""
        since = self.index.expecting_since(self.endpoint)
        if since is None:
            return
        last = self.last_batch_at
        if last is not None and last >= since:
            self.index.acknowledge(self.endpoint)
            return
        if self._silent_since is None:
            if now - since >= self.silent_after_s:
                self._silent_since = now
                self.silences += 1
                self._trust()
        elif now - self._silent_since >= self.silent_clear_s:
            self._silent_since = None
            self.clears += 1
            self.index.clear(self.endpoint)
            self.index.acknowledge(self.endpoint)
            self._trust()
