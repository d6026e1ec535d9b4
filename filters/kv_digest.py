"""An engine's cached KV blocks, rebuilt from its KV event batches (vLLM's wire format), and
the `PrefixDigest` deltas and full resyncs the agent publishes from them.

Sans-I/O: the agent (meshd/agent.py) receives `[topic, seq, payload]` from the engine's
ZMQ PUB socket and feeds `(seq, payload)` here with `now`; it asks the replay socket for
the batches `feed` says are missing. Wire format: vllm-project/vllm,
vllm/distributed/kv_events.py (`EventBatch` = msgpack `[ts, [events], dp_rank]`; events are
maps tagged by "type", or arrays `["BlockStored", ...]` in older releases); observed on a
real vLLM in /work/shared/notes/real-vllm-on-cpu.md.

Guarantee: after a loss the digest may under-report (forget blocks the engine still has),
never over-report (claim blocks it may have evicted): a gap the replay socket cannot fill
clears the set, because a missed BlockRemoved would otherwise leave a block in it forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "MAX_PENDING_BATCHES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Digest",
    "FeedResult",
    "KVDigestTracker",
    "KVEvent",
    "KVEventError",
    "decode_batch",
]

# Batches held while a gap before them is being replayed; beyond this the gap is given up.
MAX_PENDING_BATCHES = 4096
# Tiers that hold blocks an engine can serve a prefix hit from without a transfer.
GPU_MEDIA = frozenset({None, "GPU", "gpu"})


class KVEventError(ValueError):
    """A payload that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    block_size: int | None
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _hashes(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple):
        raise KVEventError("block_hashes: list expected")
    out: list[int] = []
    for h in raw:
        if isinstance(h, bytes):
            # vLLM releases before the int64 change published raw digests.
            h = int.from_bytes(h[-8:], "big")
        if not isinstance(h, int) or isinstance(h, bool):
            raise KVEventError(f"block hash {h!r} is not an integer")
        out.append(h & 0xFFFFFFFFFFFFFFFF)
    return tuple(out)


def _event(obj: Any) -> KVEvent | None:
    """One event, or None for an event type this digest does not use."""
    if isinstance(obj, dict):
        kind = obj.get("type")
        if kind == "BlockStored":
            bs = obj.get("block_size")
            return BlockStored(
                _hashes(obj.get("block_hashes")),
                bs if isinstance(bs, int) and bs > 0 else None,
                obj.get("medium", "GPU"),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(_hashes(obj.get("block_hashes")), obj.get("medium", "GPU"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    if isinstance(obj, list | tuple) and obj:
        kind = obj[0]
        if kind == "BlockStored" and len(obj) >= 5:
            bs = obj[4]
            medium = obj[6] if len(obj) > 6 else "GPU"
            return BlockStored(
                _hashes(obj[1]), bs if isinstance(bs, int) and bs > 0 else None, medium
            )
        if kind == "BlockRemoved" and len(obj) >= 2:
            return BlockRemoved(_hashes(obj[1]), obj[2] if len(obj) > 2 else "GPU")
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


class KVDigestTracker:
    """The set of block hashes one engine holds, and the digests that publish it.

    `feed(seq, payload)` batches in any order: the next expected one is applied (and any
    held ones that follow it); a later one is held and reported as a gap; an earlier one
    is a duplicate, unless its timestamp is newer than any seen, which means a new engine
    process whose counter started again (vLLM's seq starts at 0 per process).

    With `catch_up=True` a first batch after seq 0 (the agent started after the engine)
    opens a gap from 0, so the replay socket's buffer fills in what came before.

    `digest(now)` returns the next Digest (xds.resources.PrefixDigest's shape) when there
    is something to say: full at the first call, after a clear, a restart or a new epoch,
    every `resync_s`, or when the cumulative delta outgrows `max_delta_fraction` of the
    set; cumulative otherwise.
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
        self.engine = engine
        self.epoch = epoch
        self.block_size = block_size
        self.resync_s = resync_s
        self.max_delta_fraction = max_delta_fraction
        self.min_delta_blocks = min_delta_blocks
        self.max_pending = max_pending
        self.blocks: set[int] = set()
        # None: take whatever comes first (or, catching up, start from 0).
        self.next_seq: int | None = 0 if catch_up else None
        self._last_ts = float("-inf")
        self._pending: dict[int, tuple[float, list[KVEvent]]] = {}
        self._gap_since: float | None = None
        # Digest state: the set at the last full digest, and the changes since.
        self._base: set[int] = set()
        self._added: set[int] = set()
        self._removed: set[int] = set()
        self._seq = -1
        self._base_seq = 0
        self._need_full = True
        self._dirty = True
        self._last_full_at: float | None = None
        # Counters for the agent's metrics.
        self.batches = 0
        self.duplicates = 0
        self.gaps = 0
        self.lost_gaps = 0
        self.restarts = 0
        self.bad_payloads = 0

    # -- events ---------------------------------------------------------------------------

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
        restarted = False
        if self.next_seq is not None and seq < self.next_seq:
            if ts <= self._last_ts:
                self.duplicates += 1
                return FeedResult(duplicate=True)
            # A new engine process: its cache is empty, whatever it published before.
            restarted = True
            self.restarts += 1
            self._clear()
            self._pending.clear()
            self._gap_since = None
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
            if len(self._pending) > self.max_pending:
                return FeedResult(applied=self.abandon_gap(), restarted=restarted)
            return FeedResult(restarted=restarted, replay_from=self.next_seq if first_gap else None)
        self._apply(ts, events)
        self.next_seq = seq + 1
        return FeedResult(applied=1 + self._drain(), restarted=restarted)

    def _drain(self) -> int:
        n = 0
        while self.next_seq is not None and self.next_seq in self._pending:
            ts, events = self._pending.pop(self.next_seq)
            self._apply(ts, events)
            self.next_seq += 1
            n += 1
        # Held batches older than the next seq (replayed twice) are duplicates.
        for s in [s for s in self._pending if self.next_seq is not None and s < self.next_seq]:
            del self._pending[s]
        if not self._pending:
            self._gap_since = None
        return n

    def end_replay(self) -> bool:
        """The replay answer has ended: give up a gap it did not fill. Returns whether one
        was given up."""
        if self._pending:
            self.abandon_gap()
            return True
        return False

    def abandon_gap(self) -> int:
        """The missing batches will not come: forget the set (see the module docstring)
        and continue from the earliest held batch. Returns the batches then applied."""
        if not self._pending:
            return 0
        self.lost_gaps += 1
        self._clear()
        self.next_seq = min(self._pending)
        return self._drain()

    def _apply(self, ts: float, events: Iterable[KVEvent]) -> None:
        self.batches += 1
        self._last_ts = max(self._last_ts, ts)
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
