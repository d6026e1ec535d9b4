"""PrefixIndex: which prompt-prefix blocks each endpoint probably (or, from KV events,
certainly) holds, bounded per endpoint by its KV capacity with LRU eviction and a TTL.

Sans-I/O; every method that looks at age takes `now` (seconds, any monotonic origin).

Theory of operation
-------------------
Block hashes are chained (filters/blockhash.py): hash i depends on every byte before
block i, so two equal hashes imply equal prefixes, and "the first miss ends the match".
The index is one radix tree shared by all endpoints. A node holds a run of consecutive
block hashes (`seg`) and a bitmask of the endpoints holding the whole run (`mask`, and
`precise` for those whose holding a KV event confirmed). Two invariants make every
operation cheap:

* closure: an endpoint holding a node holds its parent (child.mask is a subset of
  parent.mask), so the endpoints matching a prompt only ever drop out along its path;
* chain compare: a node matches fully iff its *last* hash equals the prompt's hash at
  that depth, and a partial match is found by binary search inside the node.

So `match` walks one path (one dict lookup and one int compare per node; a partial
node costs log2 of its length) and touches an endpoint only where it drops out: O(nodes
on the path + matching endpoints), independent of the prompt's block count. A 2,000-
block prompt on a warm path is a handful of nodes. `record` walks the same path,
splitting the node where the prompt diverges and hanging the rest as one new node.

Recency is block-level LRU with vLLM's tail-first order (vllm/v1/core/kv_cache_manager.py,
`free`: blocks are freed in reverse so the tail is evicted first): a record touches every
block of its chain at once with one sequence number, and among blocks of equal recency
the deeper one goes first. Nodes are touched as a whole, so each holder's entry per node
is (seq, time, precise), ordered in a per-holder heap by (seq, -depth); eviction takes the
oldest entry and, when only part of it must go, splits off and drops its tail. A refresh
pushes nothing: an item older than its entry is moved up to the entry's seq when it
reaches the top (every item's key is at most its entry's, so the first current item on
top is the oldest entry), which keeps about one item per entry in a heap instead of one
per touch (refreshes of a hot chain had piled up ~1,700 items for ~90 entries). Because
a child's entry is never newer than its parent's for approximate records, LRU and TTL
keep closure by themselves; precise stores with a parent can break that order, so
dropping a node always drops the holder's descendants too (in vLLM a block whose parent
was evicted is unreachable anyway: lookups stop at the first miss).
A precise store with a parent also adopts the path from the root to that parent for the
holder (the engine held it to compute the new blocks), so prefixes cached before the
event stream was followed become precise as soon as a request extends them.

Approximate entries (`record`, what we routed where) count `approx_confidence` of a block
in `match_detail` and, by default, leave only as the engine's own blocks do: by LRU eviction
under the holder's capacity (vLLM frees cached blocks only when it needs the memory, never
by age), by `truncate` when the engine answered with fewer cached tokens than predicted,
and by `clear`/`observe_epoch`. A finite `ttl_s` also expires them that long after their
last touch: a hedge for an index that sees only part of an engine's traffic. On the
Mooncake trace (16 engines, virtual clock) a 120 s TTL dropped the 32% of the single-cache
bound's block reuses that come more than 120 s apart: hit rate 53.0% against 63.9% without
it (bound 64.0%), TTFT p90 45.8 against 37.1 ms. Precise entries (`store`, from KV events)
never expire and count fully (their staleness is the event stream's: demote or clear).
Expiry is incremental and bounded per query: a heap of each holder's next due time means
a query visits only holders with something to expire, and it examines at most
`expire_budget` heap items of theirs (the rest waits for the next query; holders with work
left are "behind"). What the index answers never depends on that lag: a query first moves
the expiry horizon (`_cut`) to its time, and an approximate entry touched at t with
t + ttl_s <= horizon counts as gone (with its holder's descendants, as a physical drop
takes them) in a match, in a record, and wherever else it is read, before or after it is
physically dropped. Any other change to a holder that is behind first finishes its expiry,
or, for a record, drops the expired part of its own path. A parent and its only child
that end up with the same holders and recency are merged again, so paths stay as short as
the prompts' real branch points. A per-endpoint trust factor (`demote`) discounts all of an
endpoint's entries, e.g. after missed event sequence numbers; `clear` empties it (engine
restart, AllBlocksCleared) and `observe_epoch` clears on an epoch change.

Precondition: the hashes passed in are chained (a hash determines its whole prefix).
Limits: per endpoint `capacity` blocks (set_capacity, default `default_capacity_blocks`);
per query at most `expire_budget` heap items examined for expiry (default
EXPIRE_BUDGET); a holder's heaps are rebuilt when dead items outnumber 8 x its entries +
1024, and the rebuilt-away items are freed TRASH_STEP at a time over the next updates;
the tree holds no more nodes than the holders' entries, so memory is bounded by the sum
of capacities (plus, per holder, a lazily cleaned heap of at most 8 x entries + 1024
items; with track_blocks, one dict entry per distinct block).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Sequence

__all__ = ["PrefixIndex"]

_INF = float("inf")
# Heap items examined for expiry per query. An item costs ~0.5-0.8 us (a pop, or a drop);
# an unbounded pass over a holder's stale items cost up to 1.2 ms in ~1.1% of the picks
# of `python -m loadtest.picker_bench`. That bench needs ~1 item per pick on average, so
# a budget of B costs ~B x 0.7 us in ~1/B of the picks: small B keeps it out of the tail
# (64 put ~50 us into 1.7% of them, right at the p99).
EXPIRE_BUDGET = 8
# Old heap items freed per update after a rebuild (_compact): freeing ~1,700 at once cost
# ~0.3-0.5 ms (0.07% of the bench's picks).
TRASH_STEP = 128
_ALL = 1 << 62  # a budget that never runs out


class _Node:
    __slots__ = ("children", "depth", "last", "mask", "parent", "precise", "seg")

    def __init__(self, seg: list[int], parent: _Node | None, depth: int) -> None:
        self.seg = seg
        self.last = seg[-1] if seg else 0
        self.parent = parent
        self.depth = depth  # blocks before this node's first block
        self.children: dict[int, _Node] | None = None
        self.mask = 0
        self.precise = 0


# PrefixIndex.match_keyed: (version, until, match_detail's answer).
_Keyed = tuple[int, float, dict[str, tuple[int, float]]]
# (seq, time touched, precise) of one holder's hold on one node.
_Entry = tuple[int, float, bool]
_HeapItem = tuple[int, int, int, _Node]


class _Holder:
    __slots__ = (
        "bit",
        "capacity",
        "due",
        "entries",
        "epoch",
        "expect",
        "heap",
        "index",
        "name",
        "pheap",
        "used",
    )

    def __init__(self, name: str, bit: int, capacity: int) -> None:
        self.name = name
        self.bit = bit
        self.index = bit.bit_length() - 1  # position of the bit: into PrefixIndex._trust
        self.capacity = capacity
        self.used = 0
        self.entries: dict[_Node, _Entry] = {}
        self.heap: list[_HeapItem] = []  # approximate entries (expire)
        self.pheap: list[_HeapItem] = []  # precise entries
        self.epoch: str | int | None = None
        self.due = _INF  # when its oldest approximate entry expires (inf: none queued)
        # When a record first added blocks the engine has not confirmed (acknowledge()).
        self.expect: float | None = None


def _common(node: _Node, hashes: Sequence[int], pos: int, n: int) -> int:
    """How many of node.seg's blocks match hashes[pos:], given that the first does."""
    seg = node.seg
    size = len(seg)
    end = pos + size
    if end <= n and hashes[end - 1] == node.last:
        return size
    lo = 1
    hi = min(size, n - pos)
    if hi <= lo:
        return lo
    if seg[hi - 1] == hashes[pos + hi - 1]:
        return hi
    # seg[lo-1] matches, seg[hi-1] does not; chained hashes make matching a prefix.
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if seg[mid - 1] == hashes[pos + mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixIndex:
    """Per-endpoint prefix blocks: approximate (routed there) and precise (KV events)."""

    def __init__(
        self,
        *,
        default_capacity_blocks: int = 32_768,
        ttl_s: float = _INF,
        approx_confidence: float = 0.8,
        min_trust: float = 0.05,
        track_blocks: bool = False,
        expire_budget: int = EXPIRE_BUDGET,
    ) -> None:
        """`track_blocks` keeps a hash -> node map so that `remove` and `store` with a
        parent can find a block anywhere (what a KV-event source needs); it costs a dict
        entry per block, so the speculative-only index leaves it off. `expire_budget`: heap
        items a query examines for expiry (the answers do not depend on it). `ttl_s`: age
        limit of approximate entries after their last touch (inf, the default: none; see
        the module docstring)."""
        if default_capacity_blocks < 0 or not ttl_s > 0:
            raise ValueError("capacity must be >= 0 and ttl_s > 0")
        if expire_budget < 1:
            raise ValueError("expire_budget must be >= 1")
        self.expire_budget = expire_budget
        self.default_capacity_blocks = default_capacity_blocks
        self.ttl_s = ttl_s
        self.approx_confidence = approx_confidence
        self.min_trust = min_trust
        self._root = _Node([], None, 0)
        self._holders: dict[str, _Holder] = {}
        self._by_bit: list[_Holder | None] = []
        self._trust: list[float] = []
        self._free_bits: list[int] = []
        self._seq = 0
        self._uid = itertools.count()
        self._now = -_INF
        self._next_expiry = _INF
        # (time the holder's oldest approximate entry expires, uid, holder)
        self._due: list[tuple[float, int, _Holder]] = []
        # The expiry horizon: approximate entries touched at t with t + ttl_s <= _cut are
        # gone, whether or not dropped yet. Holders that may still hold such entries are
        # "behind": their bits in _behind, themselves in _pending (oldest due first).
        self._cut = -_INF
        self._behind = 0
        self._pending: deque[_Holder] = deque()
        self._trash: list[list[_HeapItem]] = []  # rebuilt-away heaps, freed bit by bit
        self._merge: list[_Node] = []
        self._where: dict[int, _Node] | None = {} if track_blocks else None
        # Moves with every change a match could see (entries, trust, the expiry horizon and
        # its work; match_keyed).
        self.version = 0

    # -- queries -----------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Longest held prefix, in blocks, per endpoint holding at least one block."""
        return {name: m[0] for name, m in self.match_detail(hashes, now).items()}

    def match_detail(self, hashes: Sequence[int], now: float) -> dict[str, tuple[int, float]]:
        """Per endpoint with a match: (matched blocks, expected cached blocks), the latter
        weighting approximate blocks by `approx_confidence` and all by the endpoint's trust."""
        # The horizon is the index clock (the latest `now` seen), also for a late caller:
        # nothing touched ttl_s or more before the latest time the index has seen counts.
        if self._behind or now >= self._next_expiry or self._now >= self._next_expiry:
            self._advance(now)
            self._work(self.expire_budget)
        behind = self._behind
        out: dict[str, tuple[int, float]] = {}
        n = len(hashes)
        children = self._root.children
        if not n or not children:
            return out
        child = children.get(hashes[0])
        if child is None:
            return out
        k = _common(child, hashes, 0, n)
        cur = child.mask
        if cur & behind:
            cur = self._alive(child, cur)
        pcur = child.precise & cur
        pos = k
        pdrop: dict[int, int] = {}
        by_bit = self._by_bit
        trust = self._trust
        conf = self.approx_confidence
        while k == len(child.seg) and pos < n:
            children = child.children
            if not children:
                break
            nxt = children.get(hashes[pos])
            if nxt is None:
                break
            k = _common(nxt, hashes, pos, n)
            m = cur & nxt.mask
            if m & behind:
                m = self._alive(nxt, m)
            pm = pcur & nxt.precise & m
            gone = cur & ~m
            while gone:
                low = gone & -gone
                b = low.bit_length() - 1
                p = pos if pcur & low else pdrop.pop(b, 0)
                h = by_bit[b]
                assert h is not None
                out[h.name] = (pos, (p + (pos - p) * conf) * trust[b])
                gone ^= low
            lost = pcur & ~pm & m
            while lost:
                low = lost & -lost
                pdrop[low.bit_length() - 1] = pos
                lost ^= low
            cur = m
            pcur = pm
            if not cur:
                return out
            pos += k
            child = nxt
        while cur:
            low = cur & -cur
            b = low.bit_length() - 1
            p = pos if pcur & low else pdrop.get(b, 0)
            h = by_bit[b]
            assert h is not None
            out[h.name] = (pos, (p + (pos - p) * conf) * trust[b])
            cur ^= low
        return out

    def match_keyed(self, hashes: Sequence[int], now: float) -> _Keyed:
        """match_detail's answer with what says how long it holds: (the index's version,
        until, the answer). While the version is unchanged, match_detail of the same hashes
        at any time before `until` answers the same: nothing in the index has changed, and
        no expiry is due, nor work left from one (until -inf: it may not)."""
        out = self.match_detail(hashes, now)
        nxt = self._next_expiry
        until = nxt if not self._behind and self._now < nxt else -_INF
        return (self.version, until, out)

    def fan_out(self, hashes: Sequence[int], blocks: int) -> int:
        """How many ways the prompts in the tree (any endpoint's) go on past the first
        `blocks` of `hashes`: 0 at the end of an earlier prompt (a conversation's previous
        turn), 1 or more where other prompts extend it (a shared header). O(nodes on
        the path)."""
        if blocks <= 0 or blocks > len(hashes):
            return 0
        children = self._root.children
        node = children.get(hashes[0]) if children else None
        while node is not None:
            end = node.depth + len(node.seg)
            kids = node.children
            if blocks < end:
                return 1  # the stored run goes on inside this node
            if blocks == end:
                return len(kids) if kids else 0
            node = kids.get(hashes[end]) if kids else None
        return 0

    # -- updates -----------------------------------------------------------------------------

    def record(self, endpoint: str, hashes: Sequence[int], now: float) -> None:
        """Speculative: we just routed a prompt with these (root-first) hashes there."""
        self._put(endpoint, hashes, now, precise=False, parent=None)

    def store(
        self, endpoint: str, hashes: Sequence[int], now: float, *, parent: int | None = None
    ) -> bool:
        """Precise: the engine reports it stored these blocks (a KV BlockStored event),
        following `parent` (None: from the root). The path down to `parent` becomes
        precise on `endpoint` too, whoever the index learnt it from (the engine had to hold
        it to compute these blocks). Returns False, changing nothing, when the index does
        not know `parent` at all (it was stored before we listened, or evicted here)."""
        return self._put(endpoint, hashes, now, precise=True, parent=parent)

    def remove(self, endpoint: str, hashes: Iterable[int], now: float) -> None:
        """Precise: these blocks were evicted there (BlockRemoved); their descendants go
        too. Needs track_blocks=True."""
        if self._where is None:
            raise RuntimeError("remove() needs PrefixIndex(track_blocks=True)")
        h = self._holders.get(endpoint)
        if h is None:
            return
        self.version += 1
        self._clock(now)
        self._catch_up(h)
        for x in hashes:
            node = self._where.get(x)
            if node is None or not node.mask & h.bit:
                continue
            j = node.seg.index(x)
            if j:
                node = self._split(node, j)
            self._drop(h, node)
        self._settle()

    def truncate(self, endpoint: str, hashes: Sequence[int], keep: int) -> None:
        """Forget what `endpoint` holds of this chain beyond its first `keep` blocks (the
        engine reported fewer cached tokens than the index expected)."""
        h = self._holders.get(endpoint)
        if h is None:
            return
        self.version += 1
        self._catch_up(h)
        keep = max(0, keep)
        bit = h.bit
        node = self._root
        pos = 0
        n = len(hashes)
        while pos < n and node.children:
            child = node.children.get(hashes[pos])
            if child is None or not child.mask & bit:
                return
            k = _common(child, hashes, pos, n)
            if pos + k > keep:
                if keep > pos:
                    child = self._split(child, keep - pos)
                self._drop(h, child)
                self._settle()
                return
            if k < len(child.seg):
                return
            pos += k
            node = child

    def clear(self, endpoint: str) -> None:
        """Forget everything `endpoint` holds (engine restart, AllBlocksCleared)."""
        h = self._holders.get(endpoint)
        if h is None:
            return
        self.version += 1
        keep = ~h.bit
        for node in h.entries:
            node.mask &= keep
            node.precise &= keep
        for node in h.entries:
            if not node.mask and node.parent is not None:
                self._detach(node)
        h.entries.clear()
        h.heap.clear()
        h.pheap.clear()
        h.used = 0
        self._trust[h.index] = 1.0
        self._settle()

    def demote(self, endpoint: str, factor: float) -> None:
        """Discount what `endpoint` holds by `factor` (0..1), cumulatively; below
        `min_trust` its entries are dropped. Use for missed event sequence numbers."""
        h = self._holders.get(endpoint)
        if h is None:
            return
        self.version += 1
        t = self._trust[h.index] * max(0.0, factor)
        if t < self.min_trust:
            self.clear(endpoint)
        else:
            self._trust[h.index] = t

    def restore(self, endpoint: str) -> None:
        """Full trust again (after a resync)."""
        h = self._holders.get(endpoint)
        if h is not None:
            self.version += 1
            self._trust[h.index] = 1.0

    def trust(self, endpoint: str) -> float:
        h = self._holders.get(endpoint)
        return 1.0 if h is None else self._trust[h.index]

    def observe_epoch(self, endpoint: str, epoch: str | int) -> bool:
        """Note the engine's epoch; on a change (a restart) clear it and return True."""
        h = self._holder(endpoint)
        changed = h.epoch is not None and h.epoch != epoch
        if changed:
            self.clear(endpoint)
        h.epoch = epoch
        return changed

    def expecting_since(self, endpoint: str) -> float | None:
        """When a `record` first gave `endpoint` blocks it did not hold, since the last
        `acknowledge`: an engine that publishes KV events should have said something by
        now (a silent one is demoted by filters/kv_digest.KVIndexFeed)."""
        h = self._holders.get(endpoint)
        return None if h is None else h.expect

    def acknowledge(self, endpoint: str) -> None:
        """The engine's event stream is alive (a batch arrived)."""
        h = self._holders.get(endpoint)
        if h is not None:
            h.expect = None

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        h = self._holder(endpoint)
        h.capacity = max(0, int(blocks))
        if h.used > h.capacity:
            self.version += 1  # (a capacity alone changes no match: what it evicts does)
            self._catch_up(h)  # its expired entries must not count, nor be evicted
            self._evict(h)
            self._settle()

    def forget(self, endpoint: str) -> None:
        """Drop an endpoint that left the pool, freeing its bit."""
        h = self._holders.get(endpoint)
        if h is None:
            return
        self.version += 1
        self.clear(endpoint)
        del self._holders[endpoint]
        self._behind &= ~h.bit  # _pending skips it: no longer in _holders
        self._by_bit[h.index] = None
        self._free_bits.append(h.index)

    def expire(self, now: float) -> None:
        """Drop approximate entries older than ttl_s, all of them now (match_detail does
        the same work a budget at a time; what it answers is the same either way). Only
        holders whose oldest entry is due are visited (a heap of their due times), so
        steady traffic pays for the entries that actually expire, not for every holder."""
        self._advance(now)
        self._work(-1)

    # -- introspection (tests, admin) -----------------------------------------------------

    def endpoints(self) -> list[str]:
        return list(self._holders)

    def used_blocks(self, endpoint: str) -> int:
        h = self._holders.get(endpoint)
        if h is None:
            return 0
        self._catch_up(h)
        return h.used

    def capacity(self, endpoint: str) -> int:
        h = self._holders.get(endpoint)
        return self.default_capacity_blocks if h is None else h.capacity

    def held(self, endpoint: str) -> set[int]:
        """Every block hash `endpoint` holds (O(its size))."""
        h = self._holders.get(endpoint)
        out: set[int] = set()
        if h is not None:
            self._catch_up(h)
            for node in h.entries:
                out.update(node.seg)
        return out

    def node_count(self) -> int:
        self._work(-1)  # nodes only expired entries keep are not counted
        count = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            count += 1
            if node.children:
                stack.extend(node.children.values())
        return count - 1

    def check(self) -> None:
        """Assert the structural invariants (for tests)."""
        stack = [self._root]
        seen: dict[str, int] = {name: 0 for name in self._holders}
        while stack:
            node = stack.pop()
            for first, c in (node.children or {}).items():
                assert c.parent is node and c.seg and c.seg[0] == first and c.last == c.seg[-1]
                assert c.mask, "a node nobody holds must be detached"
                assert c.precise & ~c.mask == 0
                if node is not self._root:
                    assert c.mask & ~node.mask == 0, "closure: child held => parent held"
                assert c.depth == node.depth + len(node.seg)
                stack.append(c)
            for h in self._holders.values():
                if node is not self._root and node.mask & h.bit:
                    assert node in h.entries
                    seen[h.name] += len(node.seg)
        for h in self._holders.values():
            assert seen[h.name] == h.used, (h.name, seen[h.name], h.used)
            assert h.used <= h.capacity, (h.name, h.used, h.capacity)
            for node in h.entries:
                assert node.mask & h.bit

    # -- internals ---------------------------------------------------------------------------

    def _clock(self, now: float) -> float:
        # Time never runs backwards inside the index: seq order must equal time order.
        if now > self._now:
            self._now = now
        return self._now

    def _holder(self, endpoint: str) -> _Holder:
        h = self._holders.get(endpoint)
        if h is None:
            if self._free_bits:
                bit_index = self._free_bits.pop()
            else:
                bit_index = len(self._by_bit)
                self._by_bit.append(None)
                self._trust.append(1.0)
            h = _Holder(endpoint, 1 << bit_index, self.default_capacity_blocks)
            self._holders[endpoint] = h
            self._by_bit[bit_index] = h
            self._trust[bit_index] = 1.0
        return h

    def _put(
        self,
        endpoint: str,
        hashes: Sequence[int],
        now: float,
        *,
        precise: bool,
        parent: int | None,
    ) -> bool:
        self.version += 1
        n = len(hashes)
        node = self._root
        base = 0
        path: list[_Node] = []
        if parent is not None:
            if self._where is None:
                raise RuntimeError("store(parent=...) needs PrefixIndex(track_blocks=True)")
            # Whether `parent` is known depends on every holder: finish all their expiry.
            self._work(_ALL)
            found = self._where.get(parent)
            if found is None:
                return False
            h = self._holder(endpoint)
            now = self._clock(now)
            j = found.seg.index(parent)
            if j + 1 < len(found.seg):
                self._split(found, j + 1)
            node = found
            base = found.depth + len(found.seg)
            # The engine computed these blocks from `parent`, so the request held its
            # whole prefix on that engine at that moment (a running request holds all of
            # its blocks): adopt the path root..parent as precise too, whoever else the
            # tree learnt it from. Later BlockRemoved events take it back out.
            up: _Node | None = found
            while up is not None and up is not self._root:
                path.append(up)
                up = up.parent
            path.reverse()
        else:
            h = self._holder(endpoint)
            now = self._clock(now)
            if h.bit & self._behind:
                self._drop_expired_on_path(h, hashes)
        if not n and not path:
            return True
        pos = 0
        while pos < n:
            children = node.children
            child = children.get(hashes[pos]) if children else None
            if child is None:
                path.append(self._new_node(list(hashes[pos:]), node, base + pos))
                break
            k = _common(child, hashes, pos, n)
            if k < len(child.seg):
                self._split(child, k)
            path.append(child)
            pos += k
            node = child
        self._seq += 1
        seq = self._seq
        bit = h.bit
        entries = h.entries
        uid = self._uid
        any_approx = False
        for node in path:
            old = entries.get(node)
            if old is None:
                h.used += len(node.seg)
                node.mask |= bit
                prec = precise
                if not precise and h.expect is None:
                    h.expect = now
                heapq.heappush(h.pheap if prec else h.heap, (seq, -node.depth, next(uid), node))
            else:
                prec = precise or old[2]
                if prec and not old[2]:  # approximate -> precise: it needs a precise item
                    heapq.heappush(h.pheap, (seq, -node.depth, next(uid), node))
                # else its item (seq older than the entry's) is moved up when it surfaces
            if prec:
                node.precise |= bit
            else:
                any_approx = True
            entries[node] = (seq, now, prec)
            # A node that is its parent's only child and now has the same holders and
            # recency can merge into it (a re-recorded chain heals an earlier split).
            up = node.parent
            if (
                up is not None
                and up is not self._root
                and up.children is not None
                and len(up.children) == 1
            ):
                self._merge.append(up)
        if any_approx and h.due == _INF and self.ttl_s < _INF:
            h.due = now + self.ttl_s
            heapq.heappush(self._due, (h.due, next(uid), h))
            if h.due < self._next_expiry:
                self._next_expiry = h.due
        if h.used > h.capacity:
            self._catch_up(h)  # its expired entries must not count, nor be evicted
            if h.used > h.capacity:
                self._evict(h)
        # Drops leave dead heap items behind (and an entry dropped and added again can
        # have two); rebuilding is O(entries), so do it rarely (amortised O(1) per record;
        # a rebuild at 2x showed up in the p99 pick).
        if len(h.heap) + len(h.pheap) > 8 * len(entries) + 1024:
            self._compact(h)
        trash = self._trash
        if trash:
            t = trash[-1]
            del t[-TRASH_STEP:]
            if not t:
                trash.pop()
        self._settle()
        return True

    def _new_node(self, seg: list[int], parent: _Node, depth: int) -> _Node:
        node = _Node(seg, parent, depth)
        if parent.children is None:
            parent.children = {}
        parent.children[seg[0]] = node
        if self._where is not None:
            where = self._where
            for x in seg:
                where[x] = node
        return node

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut node after its first k blocks; returns the new lower part (same holders)."""
        bottom = _Node(node.seg[k:], node, node.depth + k)
        bottom.children = node.children
        if bottom.children:
            for c in bottom.children.values():
                c.parent = bottom
        bottom.mask = node.mask
        bottom.precise = node.precise
        node.seg = node.seg[:k]
        node.last = node.seg[-1]
        node.children = {bottom.seg[0]: bottom}
        uid = self._uid
        m = node.mask
        while m:
            low = m & -m
            h = self._by_bit[low.bit_length() - 1]
            assert h is not None
            e = h.entries[node]
            h.entries[bottom] = e
            heapq.heappush(h.pheap if e[2] else h.heap, (e[0], -bottom.depth, next(uid), bottom))
            m ^= low
        if self._where is not None:
            where = self._where
            for x in bottom.seg:
                where[x] = bottom
        return bottom

    def _oldest(self, h: _Holder) -> _Node | None:
        entries = h.entries
        best: _HeapItem | None = None
        for heap, is_precise in ((h.heap, False), (h.pheap, True)):
            while heap:
                item = heap[0]
                node = item[3]
                e = entries.get(node)
                if e is None or e[2] != is_precise:
                    heapq.heappop(heap)
                    continue
                if e[0] != item[0]:  # refreshed since: its item moves up to the entry's seq
                    heapq.heapreplace(heap, (e[0], -node.depth, next(self._uid), node))
                    continue
                if best is None or item[:3] < best[:3]:
                    best = item
                break
        return None if best is None else best[3]

    def _evict(self, h: _Holder) -> None:
        while h.used > h.capacity:
            node = self._oldest(h)
            if node is None:
                break
            need = h.used - h.capacity
            size = len(node.seg)
            if need < size:
                # Split off the tail; it is now the oldest (deeper at equal seq) and goes
                # on the next turn of the loop.
                self._split(node, size - need)
                continue
            self._drop(h, node)

    def _drop(self, h: _Holder, node: _Node) -> None:
        """Remove h's hold on node and on every descendant it holds."""
        bit = h.bit
        keep = ~bit
        entries = h.entries
        stack = [node]
        while stack:
            x = stack.pop()
            if entries.pop(x, None) is None:
                continue
            h.used -= len(x.seg)
            x.mask &= keep
            x.precise &= keep
            if x.children:
                stack.extend(c for c in x.children.values() if c.mask & bit)
            if not x.mask:
                self._detach(x)
            elif x.parent is not None and x.parent is not self._root:
                self._merge.append(x.parent)

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        if parent is None:
            return
        if parent.children is not None and parent.children.get(node.seg[0]) is node:
            del parent.children[node.seg[0]]
            if not parent.children:
                parent.children = None
            if parent is not self._root:
                self._merge.append(parent)
        node.parent = None
        where = self._where
        if where is not None:
            for x in node.seg:
                if where.get(x) is node:
                    del where[x]

    def _settle(self) -> None:
        """Merge parent/only-child pairs that became indistinguishable, so paths stay short."""
        pending = self._merge
        if not pending:
            return
        self._merge = []
        for p in pending:
            while p.parent is not None and p.children is not None and len(p.children) == 1:
                (c,) = p.children.values()
                if c.mask != p.mask or c.precise != p.precise:
                    break
                m = p.mask
                ok = True
                while m:
                    low = m & -m
                    h = self._by_bit[low.bit_length() - 1]
                    assert h is not None
                    if h.entries.get(p) != h.entries.get(c):
                        ok = False
                        break
                    m ^= low
                if not ok:
                    break
                m = p.mask
                while m:
                    low = m & -m
                    h = self._by_bit[low.bit_length() - 1]
                    assert h is not None
                    del h.entries[c]
                    m ^= low
                p.seg = p.seg + c.seg
                p.last = c.last
                p.children = c.children
                if p.children:
                    for g in p.children.values():
                        g.parent = p
                c.parent = None
                if self._where is not None:
                    for x in c.seg:
                        self._where[x] = p

    def _compact(self, h: _Holder) -> None:
        heap: list[_HeapItem] = []
        pheap: list[_HeapItem] = []
        uid = self._uid
        for node, (seq, _, prec) in h.entries.items():
            (pheap if prec else heap).append((seq, -node.depth, next(uid), node))
        heapq.heapify(heap)
        heapq.heapify(pheap)
        # Freeing the old items all at once was most of a rebuild's cost: _put frees them
        # TRASH_STEP at a time.
        for old in (h.heap, h.pheap):
            if old:
                self._trash.append(old)
        h.heap = heap
        h.pheap = pheap

    # -- expiry, a budget at a time ------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Move the expiry horizon to `now` (the index clock): holders whose oldest entry
        is due by then fall behind, to be worked off by _work."""
        self.version += 1
        cut = self._cut = self._clock(now)
        due = self._due
        holders = self._holders
        while due and due[0][0] <= cut:
            _, _, h = heapq.heappop(due)
            if holders.get(h.name) is not h:
                continue  # forgotten
            self._behind |= h.bit
            self._pending.append(h)
        self._next_expiry = due[0][0] if due else _INF

    def _work(self, budget: int) -> None:
        """Drop expired entries of the holders behind, oldest due first, examining at
        most `budget` heap items."""
        self.version += 1
        pending = self._pending
        holders = self._holders
        while pending:
            h = pending[0]
            if holders.get(h.name) is not h or not self._behind & h.bit:
                pending.popleft()  # forgotten, or caught up out of turn
                continue
            left = self._expire_holder(h, budget)
            if left is None:
                break
            budget = left
            pending.popleft()
        due = self._due
        self._next_expiry = due[0][0] if due else _INF
        self._settle()

    def _expire_holder(self, h: _Holder, budget: int) -> int | None:
        """Drop h's approximate entries that the horizon passed, in (seq, -depth) order,
        examining at most `budget` heap items; the budget left, or None when h is still
        behind. Done, h's next due time is queued (its oldest entry's time + ttl_s, the
        sum the horizon is compared with, so a due holder always has something due)."""
        heap = h.heap
        entries = h.entries
        ttl = self.ttl_s
        cut = self._cut
        while heap:
            if budget <= 0:
                return None
            budget -= 1
            seq, _, _, node = heap[0]
            e = entries.get(node)
            if e is None or e[2]:
                heapq.heappop(heap)
                continue
            if e[0] != seq:  # refreshed since: its item moves up to the entry's seq
                heapq.heapreplace(heap, (e[0], -node.depth, next(self._uid), node))
                continue
            at = e[1] + ttl
            if at > cut:
                h.due = at
                heapq.heappush(self._due, (at, next(self._uid), h))
                if at < self._next_expiry:
                    self._next_expiry = at
                break
            heapq.heappop(heap)
            self._drop(h, node)
        else:
            h.due = _INF
        self._behind &= ~h.bit
        return budget

    def _catch_up(self, h: _Holder) -> None:
        """Finish h's expiry (before anything reads or changes h beyond a match)."""
        if h.bit & self._behind:
            self.version += 1
            self._expire_holder(h, _ALL)
            self._settle()

    def _alive(self, node: _Node, m: int) -> int:
        """The holders in `m` (node's) less those behind whose entry on node has expired
        (they lose its descendants too: a match walks from the root, so they stay out)."""
        x = m & self._behind
        cut = self._cut
        ttl = self.ttl_s
        by_bit = self._by_bit
        while x:
            low = x & -x
            h = by_bit[low.bit_length() - 1]
            assert h is not None
            e = h.entries[node]
            if not e[2] and e[1] + ttl <= cut:
                m ^= low
            x ^= low
        return m

    def _drop_expired_on_path(self, h: _Holder, hashes: Sequence[int]) -> None:
        """h is behind and about to record this chain: drop its hold from the first
        expired node on the chain's path down (a record must see what a finished expiry
        would have left; h's expired entries elsewhere wait for _work)."""
        node = self._root
        bit = h.bit
        pos = 0
        n = len(hashes)
        cut = self._cut
        ttl = self.ttl_s
        entries = h.entries
        while pos < n and node.children:
            child = node.children.get(hashes[pos])
            if child is None or not child.mask & bit:
                return
            e = entries[child]
            if not e[2] and e[1] + ttl <= cut:
                self._drop(h, child)
                return
            k = _common(child, hashes, pos, n)
            if k < len(child.seg):
                return
            pos += k
            node = child
