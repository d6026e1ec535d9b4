"""The simulated engine's core: a vLLM-v1-like scheduler on a timing model, sans-I/O.

`EngineCore` never reads a clock, sleeps or touches a socket: time comes in as an
argument (seconds of simulated time) and results come back as values, so the HTTP server
drives it in real time and a discrete-event simulator can drive the same object on a
virtual clock::

    core.submit(req, now)               # queue a request (joins the next step)
    t = core.next_event_time()          # when to call step() next, None when idle
    result = core.step(t)               # finish the step due at t, start the next one
    result.updated                      # requests that got a token or finished

Scheduling follows vLLM v1 (vllm/v1/core/sched/scheduler.py): one token budget per step
(max_num_batched_tokens) shared by running requests first, decode and chunked prefill
alike, then by waiting requests in arrival order; a waiting request is admitted with its
longest cached prefix (blocks.BlockPool); when a running request needs a block and none
is free, the most recently admitted running request is preempted (its blocks freed, its
progress recomputed later, usually from its own cached prefix) and nothing new is
admitted that step. A step's duration comes from the GPU profile (profiles.py) times the
slowdown factor; its tokens appear when it ends.

Prefill/decode disaggregation (kv_transfer.py has the protocol) as vLLM's NIXL connector
does it (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py): a prefill step
(`SimRequest.kv_hold`) that ends length-capped keeps its blocks pinned (`HeldKV`) until a
decode step fetched them or `kv_hold_s` passed (request_finished's delay_free_blocks and
VLLM_NIXL_ABORT_REQUEST_TIMEOUT); a decode step (`SimRequest.remote`, a claimed hold) is
admitted like any request but, instead of computing its prompt, allocates the blocks its
local prefix cache lacks and waits off the GPU for the transfer (vLLM's
WAITING_FOR_REMOTE_KVS) of the missing tokens' KV over the link; then its prompt counts as
computed but for the last token (vLLM recomputes it for the logits), the producer's pinned
copy is released, and it queues at the head of the waiting line. `hold_events`, when set
(the KV transfer fabric sets it), hears of each hold's life: "held", then "fetched",
"released", "expired" or "dropped" (a restart); SGLang's protocol waits on them.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.engine.blocks import BlockPool, hash_block, none_hash
from loadtest.engine.kv_events import KVEvent
from loadtest.engine.profiles import EngineProfile
from loadtest.engine.stats import EngineStats
from loadtest.engine.tokenizer import TokenGenerator

# Llama 3's <|eot_id|>: the id an answer ends with when the generator picks EOS.
EOS_TOKEN_ID = 128_009
# How many released or expired hold ids a producer remembers, to tell a decode step
# "expired" or "already fetched" rather than "unknown".
GONE_HOLDS_MAX = 8192


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    # A decode step whose remote KV is on the wire (vLLM's WAITING_FOR_REMOTE_KVS).
    TRANSFERRING = 3


@dataclass(slots=True, eq=False)
class HeldKV:
    """A prefill step's KV, pinned on its engine for the decode step to fetch."""

    request_id: str
    block_ids: list[int]
    prompt_ids: list[int]
    expires_at: float
    claimed: bool = False


@dataclass(slots=True, eq=False)
class KVClaim:
    """A decode step's hold on a remote prefill's KV. `release(now, fetched)` unpins the
    producer's copy (after the transfer, or when the decode step ends without one)."""

    engine_id: str
    request_id: str
    release: Callable[[float, bool], None]
    done: bool = False


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request's parameters and progress. The core owns every field but `waiter`."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    seed: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    # Progress (set by the core).
    arrival: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    output_pieces: list[str] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | None = None
    cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    # True when the engine died under the request (restart): its connection must reset.
    reset: bool = False
    tail: tuple[int, int, int] = (-1, -1, -1)
    position: int = 0
    stop_window: str = ""
    # Prefill/decode disaggregation (module docstring): pin the KV at a length-capped
    # end (a prefill step), the blocks pinned, the remote KV a decode step fetches, and
    # its transfer's size and landing time.
    kv_hold: bool = False
    held_block_ids: list[int] | None = None
    remote: KVClaim | None = None
    kv_transfer_bytes: int = 0
    kv_ready_at: float | None = None
    # The driver's handle (e.g. an asyncio future to wake the HTTP handler).
    waiter: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_pieces)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def output_text(self) -> str:
        return "".join(self.output_pieces)


@dataclass(frozen=True, slots=True)
class CoreConfig:
    profile: EngineProfile
    max_model_len: int = 8192
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    hash_seed: str = "0"
    # A step ending this long before `now` (a late driver) still starts the next step at
    # its end, so the simulated GPU keeps its pace; later than that, the next step starts
    # at `now`.
    max_lag_s: float = 0.05
    # How long a prefill step's KV stays pinned, and the KV link's bytes per second.
    kv_hold_s: float = 480.0
    kv_link_bytes_per_s: float = 50e9


@dataclass(slots=True)
class StepResult:
    updated: list[SimRequest]
    kv_events: list[KVEvent]
    step_started: bool


class RequestRejected(ValueError):
    """A request the engine can never serve (too long for the model or the cache)."""


class EngineCore:
    """See the module docstring."""

    def __init__(
        self, config: CoreConfig, generator: TokenGenerator, *, stats_created: float | None = None
    ) -> None:
        p = config.profile
        self.config = config
        self.profile = p
        self.block_size = p.block_size
        self.max_num_seqs = config.max_num_seqs or p.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens or p.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.generator = generator
        self.pool = BlockPool(p.kv_blocks, p.block_size, caching=config.enable_prefix_caching)
        self.stats = EngineStats(config.max_model_len, stats_created)
        self.slowdown = 1.0
        self._none_hash = none_hash(config.hash_seed)
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self._batch: list[SimRequest] = []
        self._batch_tokens: list[int] = []
        self._finish_at: float | None = None
        # The GPU runs one step at a time: nothing starts before the last step ended.
        self._last_finish = float("-inf")
        self._wake_at: float | None = None
        self._paused_since: float | None = None
        self._paused_until = 0.0
        self._prune = False
        self._events: list[KVEvent] = []
        # Disaggregation: pinned prefill KV by request id, its expiry heap, ids lately
        # released (-> why a fetch fails), and decode steps whose KV is on the wire.
        self._holds: dict[str, HeldKV] = {}
        self._hold_heap: list[tuple[float, int, str]] = []
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._transfers: list[tuple[float, int, SimRequest]] = []
        self._num_transferring = 0
        self._seq = itertools.count()
        self.hold_events: Callable[[str, str], None] | None = None
        self.steps = 0
        self.busy_time = 0.0

    # ---- views -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return sum(1 for r in self._running if r.status is Status.RUNNING)

    @property
    def num_waiting(self) -> int:
        # vLLM counts a request waiting for its remote KV as waiting.
        return len(self._waiting) + self._num_transferring

    @property
    def num_transferring(self) -> int:
        return self._num_transferring

    @property
    def num_held_requests(self) -> int:
        return len(self._holds)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self._holds.values())

    @property
    def paused(self) -> bool:
        return self._paused_since is not None

    def busy_time_at(self, now: float) -> float:
        """Simulated GPU-busy seconds up to `now` (the in-flight step counts in part)."""
        if self._finish_at is None or self._paused_since is not None:
            return self.busy_time
        return self.busy_time - max(0.0, self._finish_at - now)

    def kv_usage(self) -> float:
        return self.pool.usage()

    def requests(self) -> list[SimRequest]:
        live = [r for r in self._running if r.status is Status.RUNNING]
        return live + list(self._waiting) + self._in_transfer()

    def _in_transfer(self) -> list[SimRequest]:
        return [r for _, _, r in sorted(self._transfers) if r.status is Status.TRANSFERRING]

    # ---- inputs ------------------------------------------------------------------
    def submit(self, req: SimRequest, now: float) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty")
        if n + req.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"{n} prompt tokens + {req.max_tokens} max_tokens exceed max_model_len "
                f"{self.max_model_len}"
            )
        bs = self.block_size
        need = -(-(n + req.max_tokens) // bs)
        if need > self.pool.num_blocks:
            raise RequestRejected(
                f"the request needs {need} KV blocks; the engine has {self.pool.num_blocks}"
            )
        req.arrival = now
        req.token_ids = list(req.prompt_ids)
        req.tail, req.position = self.generator.context_tail(req.prompt_ids)
        if self.pool.caching:
            self._extend_hashes(req, (n - 1) // bs)
        req.status = Status.WAITING
        self._waiting.append(req)
        if self._finish_at is None and self._wake_at is None:
            self._wake_at = now

    def abort(self, req: SimRequest, now: float) -> None:
        """The client went away: drop the request and free its blocks."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.WAITING:
            with contextlib.suppress(ValueError):
                self._waiting.remove(req)
        self._finish(req, "abort", now)

    def set_slowdown(self, factor: float) -> None:
        """Steps started from now on take `factor` times as long (a degraded GPU)."""
        if factor <= 0:
            raise ValueError("slowdown factor must be positive")
        self.slowdown = factor

    def pause(self, now: float, until: float = float("inf")) -> None:
        """Freeze the GPU (a hang, weights loading): no step ends or starts before `until`."""
        if self._paused_since is None:
            self._paused_since = now
        self._paused_until = until

    def resume(self, now: float) -> None:
        since = self._paused_since
        if since is None:
            return
        self._paused_since = None
        if self._finish_at is not None:
            self._finish_at += max(0.0, now - since)
        elif self._waiting or self._running:
            self._wake_at = now

    def restart(self, now: float) -> list[SimRequest]:
        """The engine process dies and comes back empty; returns the requests it dropped."""
        dropped = [r for r in self._running if r.status is Status.RUNNING]
        dropped += list(self._waiting)
        dropped += self._in_transfer()
        self._waiting.clear()
        for r in dropped:
            r.reset = True
            self._finish(r, "abort", now, record=False)
        self._transfers = []
        # Pinned prefill KV dies with the process: a decode step asking for it is refused.
        gone = list(self._holds)
        for held in self._holds.values():
            self.pool.free(held.block_ids)
        self._holds.clear()
        for rid in gone:
            self._tell(rid, "dropped")
        self._hold_heap = []
        self._gone.clear()
        self._running = []
        self._batch = []
        self._batch_tokens = []
        self._finish_at = None
        self._wake_at = None
        self._paused_since = None
        self.pool.reset()
        self._events.extend(self.pool.take_events())
        # A new process starts with fresh counters; a degraded GPU stays degraded.
        self.stats = EngineStats(self.max_model_len)
        return dropped

    def take_events(self) -> list[KVEvent]:
        events = self._events + self.pool.take_events()
        self._events = []
        return events

    # ---- disaggregation: the producer's side -------------------------------------
    def held(self, request_id: str) -> HeldKV | None:
        return self._holds.get(request_id)

    def hold_fate(self, request_id: str) -> str | None:
        """None while `request_id`'s KV is pinned (claimed or not); else why not (as
        claim_hold says it, "already_fetched" for a hold whose KV was fetched)."""
        if request_id in self._holds:
            return None
        return self._gone.get(request_id, "unknown_request")

    def claim_hold(
        self,
        request_id: str,
        block_ids: Sequence[int] | None,
        prompt_ids: Sequence[int],
        now: float,
    ) -> HeldKV | str:
        """A decode step asks for the KV of prefill `request_id`: the hold (now claimed:
        it no longer expires) or why not: "unknown_request", "expired", "already_fetched",
        "released" (its decode step ended before fetching) or "mismatch" (other blocks or
        another prompt than the prefill's). `block_ids` None: any blocks (SGLang's decode
        step names a room, not blocks)."""
        if self._expire_holds(now):
            self._nudge(now)
        held = self._holds.get(request_id)
        if held is None:
            return self._gone.get(request_id, "unknown_request")
        if held.claimed:
            return "already_fetched"
        other_blocks = block_ids is not None and held.block_ids != list(block_ids)
        if other_blocks or held.prompt_ids != list(prompt_ids):
            return "mismatch"
        held.claimed = True
        return held

    def release_hold(self, held: HeldKV, now: float, *, fetched: bool) -> None:
        """Unpin a claimed hold: its blocks stay in the prefix cache as ordinary free ones."""
        if self._holds.get(held.request_id) is not held:
            return
        del self._holds[held.request_id]
        self.pool.free(held.block_ids)
        self._remember(held.request_id, "already_fetched" if fetched else "released")
        if fetched:
            self.stats.kv_holds_fetched += 1
        self._nudge(now)
        self._tell(held.request_id, "fetched" if fetched else "released")

    def _hold(self, req: SimRequest, t: float) -> None:
        old = self._holds.pop(req.request_id, None)
        if old is not None:
            # A second prefill step under the same id replaces the first.
            self.pool.free(old.block_ids)
        held = HeldKV(req.request_id, req.block_ids, req.prompt_ids, t + self.config.kv_hold_s)
        self._holds[req.request_id] = held
        self._gone.pop(req.request_id, None)
        heapq.heappush(self._hold_heap, (held.expires_at, next(self._seq), req.request_id))
        req.held_block_ids = list(req.block_ids)
        self.stats.kv_prefill_steps += 1
        self._tell(req.request_id, "held")

    def _tell(self, request_id: str, event: str) -> None:
        if self.hold_events is not None:
            self.hold_events(request_id, event)

    def _remember(self, request_id: str, reason: str) -> None:
        gone = self._gone
        gone[request_id] = reason
        gone.move_to_end(request_id)
        if len(gone) > GONE_HOLDS_MAX:
            gone.popitem(last=False)

    def _expire_holds(self, now: float) -> bool:
        """Unpin every unclaimed hold whose time is up; True when any was."""
        heap = self._hold_heap
        freed = False
        while heap and heap[0][0] <= now:
            at, _, rid = heapq.heappop(heap)
            held = self._holds.get(rid)
            if held is None or held.claimed or held.expires_at != at:
                continue
            del self._holds[rid]
            self.pool.free(held.block_ids)
            self._remember(rid, "expired")
            self.stats.kv_holds_expired += 1
            freed = True
            self._tell(rid, "expired")
        return freed

    def _next_hold_expiry(self) -> float | None:
        heap = self._hold_heap
        while heap:
            at, _, rid = heap[0]
            held = self._holds.get(rid)
            if held is not None and not held.claimed and held.expires_at == at:
                return at
            heapq.heappop(heap)
        return None

    def _nudge(self, now: float) -> None:
        """Blocks came free outside a step: an idle GPU with work waiting starts again."""
        if (
            self._finish_at is None
            and self._wake_at is None
            and self._paused_since is None
            and self._waiting
        ):
            self._wake_at = now

    # ---- disaggregation: the consumer's side -------------------------------------
    def _start_transfer(self, req: SimRequest, start: float) -> bool:
        """Admit decode step `req`: allocate the blocks its local prefix cache lacks and
        put the missing tokens' KV on the wire. False when the blocks are not free."""
        pool = self.pool
        bs = self.block_size
        n = len(req.token_ids)
        hit: list[int] = []
        if pool.caching:
            max_hit = (n - 1) // bs
            if len(req.block_hashes) < max_hit:
                self._extend_hashes(req, max_hit)
            hit = pool.cached_prefix(req.block_hashes[:max_hit])
        need = (n + bs - 1) // bs - len(hit)
        if need > pool.free_after_touch(hit):
            return False
        pool.touch(hit)
        req.block_ids = hit + (pool.allocate(need) or [])
        req.num_cached_blocks = len(hit)
        local = len(hit) * bs
        nbytes = (n - local) * self.profile.kv_bytes_per_token
        req.kv_transfer_bytes = nbytes
        req.kv_ready_at = start + nbytes / self.config.kv_link_bytes_per_s
        req.status = Status.TRANSFERRING
        self._num_transferring += 1
        heapq.heappush(self._transfers, (req.kv_ready_at, next(self._seq), req))
        stats = self.stats
        stats.prefix_cache_queries += n
        stats.prefix_cache_hits += local
        if req.first_scheduled is None:
            req.first_scheduled = start
            stats.prompt_tokens_cached += local
        return True

    def _next_transfer(self) -> float | None:
        heap = self._transfers
        while heap:
            if heap[0][2].status is Status.TRANSFERRING:
                return heap[0][0]
            heapq.heappop(heap)
        return None

    def _land_transfers(self, now: float) -> None:
        """Transfers done by `now`: the prompt's KV is in place but for its last token."""
        heap = self._transfers
        landed: list[SimRequest] = []
        bs = self.block_size
        stats = self.stats
        while heap and heap[0][0] <= now:
            ready, _, req = heapq.heappop(heap)
            if req.status is not Status.TRANSFERRING:
                continue
            self._num_transferring -= 1
            n = len(req.token_ids)
            req.num_computed = n - 1
            if self.pool.caching:
                full = (n - 1) // bs
                if full > req.num_cached_blocks:
                    if len(req.block_hashes) < full:
                        self._extend_hashes(req, full)
                    self.pool.cache_blocks(
                        req.block_ids, req.block_hashes, req.token_ids, req.num_cached_blocks, full
                    )
                    req.num_cached_blocks = full
            req.cached_tokens = n - 1
            req.status = Status.WAITING
            claim = req.remote
            if claim is not None and not claim.done:
                claim.done = True
                claim.release(ready, True)
            seconds = req.kv_transfer_bytes / self.config.kv_link_bytes_per_s
            stats.kv_remote_decode_steps += 1
            stats.kv_transfer_bytes += req.kv_transfer_bytes
            stats.kv_transfer_seconds += seconds
            stats.nixl_xfer_time.observe(seconds)
            stats.nixl_bytes_transferred.observe(req.kv_transfer_bytes)
            landed.append(req)
        self._waiting.extendleft(reversed(landed))

    # ---- time --------------------------------------------------------------------
    def next_event_time(self) -> float | None:
        if self._paused_since is not None:
            return self._paused_until if self._paused_until != float("inf") else None
        if self._finish_at is not None:
            return self._finish_at
        t = self._wake_at
        if self._transfers:
            r = self._next_transfer()
            if r is not None and (t is None or r < t):
                t = r
        if self._hold_heap:
            e = self._next_hold_expiry()
            if e is not None and (t is None or e < t):
                t = e
        return t

    def step(self, now: float) -> StepResult:
        updated: list[SimRequest] = []
        if self._paused_since is not None:
            if now < self._paused_until:
                return StepResult(updated, self.take_events(), False)
            self.resume(self._paused_until)
        start = now
        wake = self._wake_at
        if wake is not None and now - wake <= self.config.max_lag_s:
            # Work that arrived while idle starts when it arrived, not when the driver
            # got round to it (its wake-up latency is not GPU time).
            start = max(wake, self._last_finish)
        if self._finish_at is not None:
            finish = self._finish_at
            if now < finish:
                return StepResult(updated, self.take_events(), False)
            self._complete(finish, updated)
            self._finish_at = None
            self._last_finish = finish
            start = finish if now - finish <= self.config.max_lag_s else now
        self._wake_at = None
        if self._hold_heap:
            self._expire_holds(now)
        if self._transfers:
            self._land_transfers(start)
        started = False
        if self._waiting or self._running:
            started = self._schedule(start)
        return StepResult(updated, self.take_events(), started)

    # ---- internals ---------------------------------------------------------------
    def _extend_hashes(self, req: SimRequest, full_blocks: int) -> None:
        hashes = req.block_hashes
        bs = self.block_size
        toks = req.token_ids
        prev = hashes[-1] if hashes else self._none_hash
        for b in range(len(hashes), full_blocks):
            prev = hash_block(prev, toks[b * bs : (b + 1) * bs])
            hashes.append(prev)

    def _preempt(self, req: SimRequest) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.num_cached_blocks = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._waiting.appendleft(req)

    def _schedule(self, start: float) -> bool:
        if self._prune:
            self._running = [r for r in self._running if r.status is Status.RUNNING]
            self._prune = False
        pool = self.pool
        bs = self.block_size
        budget = self.max_num_batched_tokens
        running = self._running
        batch: list[SimRequest] = []
        batch_tokens: list[int] = []
        tokens = 0
        pairs = 0.0
        kv_read = 0
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed
            n = len(req.token_ids) - computed
            if n > budget:
                n = budget
            need = (computed + n + bs - 1) // bs - len(req.block_ids)
            if need > 0:
                while need > pool.num_free:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if req.status is not Status.RUNNING:
                    break
                req.block_ids.extend(pool.allocate(need) or ())
            batch.append(req)
            batch_tokens.append(n)
            budget -= n
            tokens += n
            kv_read += computed + n
            pairs += n * computed + n * (n + 1) / 2
            i += 1
        if not preempted:
            waiting = self._waiting
            caching = pool.caching
            stats = self.stats
            while waiting and budget > 0 and len(running) < self.max_num_seqs:
                req = waiting[0]
                if req.remote is not None and req.kv_ready_at is None:
                    # A decode step: its prompt's KV comes over the wire, off the GPU.
                    if not self._start_transfer(req, start):
                        break
                    waiting.popleft()
                    continue
                if req.block_ids:
                    # Its remote KV landed: only the prompt's last token is left to compute.
                    computed = req.num_computed
                    n = len(req.token_ids) - computed
                    if n > budget:
                        n = budget
                    need = (computed + n + bs - 1) // bs - len(req.block_ids)
                    if need > pool.num_free:
                        break
                    waiting.popleft()
                    if need > 0:
                        req.block_ids.extend(pool.allocate(need) or ())
                    req.status = Status.RUNNING
                    running.append(req)
                    batch.append(req)
                    batch_tokens.append(n)
                    budget -= n
                    tokens += n
                    kv_read += computed + n
                    pairs += n * computed + n * (n + 1) / 2
                    continue
                num_tokens = len(req.token_ids)
                hit: list[int] = []
                if caching:
                    max_hit = (num_tokens - 1) // bs
                    if len(req.block_hashes) < max_hit:
                        self._extend_hashes(req, max_hit)
                    hit = pool.cached_prefix(req.block_hashes[:max_hit])
                cached = len(hit) * bs
                n = num_tokens - cached
                if n > budget:
                    n = budget
                need = (cached + n + bs - 1) // bs - len(hit)
                if need > pool.free_after_touch(hit):
                    break
                waiting.popleft()
                pool.touch(hit)
                req.block_ids = hit + (pool.allocate(need) or [])
                req.num_computed = cached
                req.num_cached_blocks = len(hit)
                req.status = Status.RUNNING
                stats.prefix_cache_queries += num_tokens
                stats.prefix_cache_hits += cached
                if req.first_scheduled is None:
                    req.first_scheduled = start
                    req.cached_tokens = cached
                    stats.prompt_tokens_cached += cached
                running.append(req)
                batch.append(req)
                batch_tokens.append(n)
                budget -= n
                tokens += n
                kv_read += cached + n
                pairs += n * cached + n * (n + 1) / 2
        if not batch:
            # Everything running was preempted this step; admit again on the next call.
            # (Otherwise the head of the line waits for blocks pinned by KV holds or
            # transfers: their expiry, release or landing wakes the core.)
            self._wake_at = start if self._waiting and preempted else None
            return False
        duration = self.profile.step_time(len(batch), tokens, pairs, kv_read) * self.slowdown
        self._batch = batch
        self._batch_tokens = batch_tokens
        self._finish_at = start + duration
        self.stats.iteration_tokens.observe(tokens)
        self.steps += 1
        self.busy_time += duration
        return True

    def _complete(self, t: float, updated: list[SimRequest]) -> None:
        pool = self.pool
        bs = self.block_size
        caching = pool.caching
        running = Status.RUNNING
        for req, n in zip(self._batch, self._batch_tokens, strict=True):
            if req.status is not running:
                continue
            req.num_computed += n
            computed = req.num_computed
            if caching:
                full = computed // bs
                if full > req.num_cached_blocks:
                    if len(req.block_hashes) < full:
                        self._extend_hashes(req, full)
                    pool.cache_blocks(
                        req.block_ids,
                        req.block_hashes,
                        req.token_ids,
                        req.num_cached_blocks,
                        full,
                    )
                    req.num_cached_blocks = full
            if computed >= len(req.token_ids):
                self._sample(req, t)
                updated.append(req)
        self._batch = []
        self._batch_tokens = []

    def _sample(self, req: SimRequest, t: float) -> None:
        stats = self.stats
        nt = self.generator.next(req.tail, req.position, req.seed)
        if req.first_token_time is None:
            req.first_token_time = t
            stats.ttft.observe(t - req.arrival)
            stats.prompt_tokens += len(req.prompt_ids)
        elif req.last_token_time is not None:
            stats.itl.observe(t - req.last_token_time)
        req.last_token_time = t
        stats.generation_tokens += 1
        if nt.eos and not req.ignore_eos and len(req.output_pieces) >= req.min_tokens:
            req.token_ids.append(EOS_TOKEN_ID)
            req.output_pieces.append("")
            self._finish(req, "stop", t)
            return
        tid = nt.token_id
        piece = nt.piece
        req.token_ids.append(tid)
        tail = req.tail
        req.tail = (tail[1], tail[2], tid)
        req.position += 1
        if req.stop:
            before = req.stop_window
            window = before + piece
            for s in req.stop:
                at = window.find(s)
                if at >= 0:
                    keep = at - len(before)
                    req.output_pieces.append(piece[:keep] if keep > 0 else "")
                    req.stop_reason = s
                    self._finish(req, "stop", t)
                    return
            longest = max(len(s) for s in req.stop)
            req.stop_window = window[-longest:]
        req.output_pieces.append(piece)
        if len(req.output_pieces) >= req.max_tokens or len(req.token_ids) >= self.max_model_len:
            self._finish(req, "length", t)

    def _finish(self, req: SimRequest, reason: str, t: float, *, record: bool = True) -> None:
        was_running = req.status is Status.RUNNING
        if req.status is Status.TRANSFERRING:
            self._num_transferring -= 1
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = t
        if req.block_ids:
            if req.kv_hold and reason == "length" and record:
                # vLLM pins a prefill step's blocks only when it ended length-capped.
                self._hold(req, t)
            else:
                self.pool.free(req.block_ids)
            req.block_ids = []
        claim = req.remote
        if claim is not None and not claim.done:
            # Ended before its KV landed: the producer need not keep it (vLLM notifies it).
            claim.done = True
            claim.release(t, False)
        if was_running:
            self._prune = True
        if not record:
            return
        s = self.stats
        s.request_success[reason] = s.request_success.get(reason, 0) + 1
        s.e2e.observe(t - req.arrival)
        if req.first_scheduled is not None:
            s.queue_time.observe(req.first_scheduled - req.arrival)
            s.inference_time.observe(t - req.first_scheduled)
            if req.first_token_time is not None:
                s.prefill_time.observe(req.first_token_time - req.first_scheduled)
                s.decode_time.observe(t - req.first_token_time)
        s.request_prompt_tokens.observe(len(req.prompt_ids))
        s.request_generation_tokens.observe(len(req.output_pieces))
        s.max_tokens_param.observe(req.max_tokens)


def run_until_idle(
    core: EngineCore, now: float = 0.0, *, limit: int = 1_000_000
) -> tuple[float, list[SimRequest]]:
    """Drive `core` on a virtual clock until nothing is left to do (tests, offline runs).

    Returns the clock at the end and every request update in order.
    """
    seen: list[SimRequest] = []
    for _ in range(limit):
        t = core.next_event_time()
        if t is None:
            return now, seen
        now = max(now, t)
        seen.extend(core.step(now).updated)
    raise RuntimeError("engine did not go idle")


def submit_all(core: EngineCore, reqs: Sequence[SimRequest], now: float) -> None:
    for r in reqs:
        core.submit(r, now)
