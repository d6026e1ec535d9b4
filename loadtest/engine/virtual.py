"""The engine fleet on a virtual clock: no sockets, no sleeps, time is an argument.

`VirtualFleet` holds one `VirtualEngine` per `EngineSpec`, each the same `EngineReplica`
(request parsing, EngineCore's step model, fault state) that `SimEngine` serves over HTTP;
only the driver differs. The fleet keeps one heap of due engine events (a step ending,
a fault's `at`), so a discrete-event driver merges it with its own events::

    fleet = VirtualFleet(specs)
    r = fleet[i].submit("chat", body, "req-1", now, stream)   # Accepted or Refused
    while (t := fleet.next_event_time()) is not None and t <= horizon:
        fleet.run_next()              # one step (or fault) at t; streams hear of tokens

A request's `Stream` is told `on_tokens(engine, req, now)` after each step that gave it a
token or finished it, and `on_reset(engine, req, delivered, now)` when its connection
would have been reset (an injected crash after N tokens, or a restart); the HTTP driver
does the same through its SSE sink. A virtual clock is never late, so steps start exactly
when the previous one ends (CoreConfig.max_lag_s = 0) and a 1,000-engine fleet costs only
the steps it runs.

Prefill/decode disaggregation (kv_transfer.py): the fleet's engines share one KV transfer
fabric on the fleet's clock; `VirtualEngine.transfer_params(req)` is what a finished
prefill step's answer carries.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from loadtest.engine import api
from loadtest.engine.config import EngineSpec
from loadtest.engine.core import EngineCore, RequestRejected, SimRequest
from loadtest.engine.faults import ColdStartMode, FaultSpec
from loadtest.engine.kv_events import KVEvent
from loadtest.engine.kv_transfer import KVTransferFabric
from loadtest.engine.replica import EngineReplica, Refusal
from loadtest.engine.tokenizer import Tokenizer, load_tokenizer

# A status of 0: no HTTP answer at all (the engine refuses connections while it loads).
CONNECT_REFUSED = 0

KVEventSink = Callable[["VirtualEngine", list[KVEvent], float], None]


class Stream(Protocol):
    """What the driver hears about one accepted request."""

    def on_tokens(self, engine: VirtualEngine, req: SimRequest, now: float) -> None: ...

    def on_reset(
        self, engine: VirtualEngine, req: SimRequest, delivered: int, now: float
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class Accepted:
    req: SimRequest


@dataclass(frozen=True, slots=True)
class Refused:
    """No stream: `status` is the HTTP error (CONNECT_REFUSED: the connection failed)."""

    status: int
    message: str
    retry_after: float | None = None


class VirtualEngine:
    """One engine on the virtual clock (see the module docstring)."""

    __slots__ = ("_fleet", "_streams", "replica", "scheduled_at")

    def __init__(self, replica: EngineReplica, fleet: VirtualFleet) -> None:
        self.replica = replica
        self._fleet = fleet
        self._streams: dict[SimRequest, Stream] = {}
        # The time of this engine's live heap entry (None: nothing due).
        self.scheduled_at: float | None = None

    @property
    def name(self) -> str:
        return self.replica.name

    @property
    def index(self) -> int:
        return self.replica.index

    @property
    def core(self) -> EngineCore:
        return self.replica.core

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def submit(
        self,
        kind: api.RequestKind,
        body: bytes | dict[str, Any],
        request_id: str,
        now: float,
        stream: Stream,
    ) -> Accepted | Refused:
        """A POST to /v1/completions or /v1/chat/completions arriving at `now`."""
        rep = self.replica
        faults = rep.faults
        if faults.refusing(now):
            return Refused(CONNECT_REFUSED, "connection refused: the engine is loading")
        rej: Refusal | None = rep.refusal(now, generation=True)
        if rej is not None:
            return Refused(rej.status, rej.message, rej.retry_after)
        try:
            doc = json.loads(body) if isinstance(body, bytes | bytearray) else body
            parsed = rep.parse(kind, doc)
        except ValueError as exc:
            return Refused(400, f"the request body is not valid JSON: {exc}")
        except api.ApiError as exc:
            return Refused(exc.status, exc.message)
        try:
            req = rep.submit(parsed, api.request_id(kind, request_id), now)
        except api.ApiError as exc:
            return Refused(exc.status, exc.message)
        except RequestRejected as exc:
            return Refused(400, str(exc))
        self._streams[req] = stream
        self._fleet._reschedule(self)
        return Accepted(req)

    def transfer_params(self, req: SimRequest) -> dict[str, Any] | None:
        """A finished prefill step's `kv_transfer_params` (None: nothing was pinned); the
        host is "virtual" and the port the engine's index."""
        return self.replica.transfer_params(req, "virtual", self.index)

    def abort(self, req: SimRequest, now: float) -> None:
        """The client went away (timeout, cancel)."""
        if self._streams.pop(req, None) is not None:
            self.replica.core.abort(req, now)
            self._fleet._reschedule(self)

    def inject(self, fault: FaultSpec, now: float) -> None:
        """Apply a fault now (the virtual twin of POST /admin/fault)."""
        rep = self.replica
        action = rep.apply_fault(fault, now)
        if action == "restart":
            dropped = rep.core.restart(now)
            self._fleet._publish(self, rep.core.take_events(), now)
            for req in dropped:
                stream = self._streams.pop(req, None)
                if stream is not None:
                    stream.on_reset(self, req, req.num_output_tokens, now)
            if fault.seconds:
                rep.faults.start_loading(now, fault.seconds, fault.mode)
        elif action == "cold_start":
            rep.faults.start_loading(now, fault.seconds or 0.0, fault.mode)
        self._fleet._reschedule(self)

    def step(self, now: float) -> None:
        rep = self.replica
        result = rep.core.step(now)
        if result.kv_events:
            self._fleet._publish(self, result.kv_events, now)
        if not result.updated:
            return
        faults = rep.faults
        streams = self._streams
        crashes = faults.peek_crash() is not None
        for req in result.updated:
            stream = streams.get(req)
            if stream is None:
                continue
            if crashes:
                limit = faults.stream_crash_due(req.num_output_tokens, req.finished)
                if limit is not None:
                    # As the SSE sink does: `limit` tokens reach the client, then a reset.
                    faults.take_crash()
                    del streams[req]
                    rep.core.abort(req, now)
                    stream.on_reset(self, req, limit, now)
                    crashes = faults.peek_crash() is not None
                    continue
            if req.finished:
                del streams[req]
            stream.on_tokens(self, req, now)


class VirtualFleet:
    """Engines of `specs` on one virtual clock starting at 0 (see the module docstring)."""

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        *,
        kv_event_sink: KVEventSink | None = None,
    ) -> None:
        if not specs:
            raise ValueError("a fleet needs at least one engine")
        tokenizers: dict[str | None, Tokenizer] = {}
        self.engines: list[VirtualEngine] = []
        self._heap: list[tuple[float, int, int, FaultSpec | None]] = []
        self._seq = itertools.count()
        self.kv_event_sink = kv_event_sink
        self.fabric = KVTransferFabric()
        self.now = 0.0
        self.steps = 0
        for i, spec in enumerate(specs):
            tok = tokenizers.get(spec.tokenizer)
            if tok is None:
                tok = tokenizers[spec.tokenizer] = load_tokenizer(spec.tokenizer)
            engine = VirtualEngine(EngineReplica(spec, index=i, tokenizer=tok), self)
            self.engines.append(engine)
            engine.replica.connect(self.fabric, wake=self._waker(engine))
            if spec.cold_start_s > 0:
                mode: ColdStartMode = (
                    "unavailable" if spec.cold_start_mode == "unavailable" else "refuse"
                )
                engine.replica.faults.start_loading(0.0, spec.cold_start_s, mode)
            for fault in spec.faults:
                if fault.at is None:
                    engine.inject(fault, 0.0)
                else:
                    heapq.heappush(self._heap, (fault.at, next(self._seq), i, fault))

    def __len__(self) -> int:
        return len(self.engines)

    def __getitem__(self, i: int) -> VirtualEngine:
        return self.engines[i]

    def __iter__(self) -> Iterator[VirtualEngine]:
        return iter(self.engines)

    def schedule(self, index: int, fault: FaultSpec) -> None:
        """Apply `fault` to engine `index` at its `at` (now when it has none)."""
        if fault.at is None or fault.at <= self.now:
            self.engines[index].inject(fault, self.now)
        else:
            heapq.heappush(self._heap, (fault.at, next(self._seq), index, fault))

    def next_event_time(self) -> float | None:
        """When the next engine event is due, None when every engine is idle."""
        heap = self._heap
        engines = self.engines
        while heap:
            t, _, i, fault = heap[0]
            if fault is not None or engines[i].scheduled_at == t:
                return t
            heapq.heappop(heap)  # superseded by a later reschedule
        return None

    def run_next(self) -> float | None:
        """Run the next due engine event; returns its time (None when nothing is due)."""
        t = self.next_event_time()
        if t is None:
            return None
        _, _, i, fault = heapq.heappop(self._heap)
        self.now = max(self.now, t)
        engine = self.engines[i]
        if fault is not None:
            engine.inject(fault, self.now)
            return t
        engine.scheduled_at = None
        engine.step(self.now)
        self.steps += 1
        self._reschedule(engine)
        return t

    def run_until(self, horizon: float) -> None:
        """Run every engine event due at or before `horizon`, then set the clock to it."""
        while (t := self.next_event_time()) is not None and t <= horizon:
            self.run_next()
        self.now = max(self.now, horizon)

    def _waker(self, engine: VirtualEngine) -> Callable[[], None]:
        return lambda: self._reschedule(engine)

    def _reschedule(self, engine: VirtualEngine) -> None:
        t = engine.replica.core.next_event_time()
        if t == engine.scheduled_at:
            return
        engine.scheduled_at = t
        if t is not None:
            heapq.heappush(self._heap, (t, next(self._seq), engine.index, None))

    def _publish(self, engine: VirtualEngine, events: list[KVEvent], now: float) -> None:
        if events and self.kv_event_sink is not None:
            self.kv_event_sink(engine, events, now)
