"""Fault injection for the engine simulator: the fault kinds, their parsing, and their state.

Sans-I/O: `FaultState` answers questions the HTTP layer asks (reject this request with a
status? reset this stream after how many tokens? is the engine loading?) and the server
turns the answers into I/O. Faults come from POST /admin/fault or from an engine's config
(optionally `at` a simulated time after start). Kinds (JSON):

    {"kind": "crash_after_tokens", "tokens": N, "count": 1}   reset the connection (RST)
        of the next `count` requests after N tokens were sent (count -1: every request)
    {"kind": "status_burst", "status": 503, "count": 5, "retry_after": 1}
        answer the next `count` requests with that status (429, 500, 503...)
    {"kind": "slowdown", "factor": 10}       every step takes 10x as long (1 restores); it
        survives a restart, as a degraded GPU would
    {"kind": "hang", "seconds": S}           the GPU stops (HTTP still answers, /health too,
        as with a wedged GPU behind a live API server); omit seconds to hang until cleared
    {"kind": "restart", "cold_start_seconds": S, "mode": "refuse"}
        drop every request (connections reset), clear the KV cache (AllBlocksCleared),
        reset the counters, then load weights for S seconds
    {"kind": "cold_start", "seconds": S, "mode": "refuse"}
        weights loading for S seconds: "refuse" closes the listener (connection refused),
        "unavailable" answers 503 to everything including /health
    {"kind": "clear"}                        remove every fault
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

FaultKind = Literal[
    "crash_after_tokens", "status_burst", "slowdown", "hang", "restart", "cold_start", "clear"
]
ColdStartMode = Literal["refuse", "unavailable"]
FAULT_KINDS: tuple[str, ...] = (
    "crash_after_tokens",
    "status_burst",
    "slowdown",
    "hang",
    "restart",
    "cold_start",
    "clear",
)


class FaultError(ValueError):
    """A malformed fault description."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: FaultKind
    tokens: int = 0
    count: int = 1
    status: int = 503
    retry_after: float | None = None
    factor: float = 1.0
    seconds: float | None = None
    mode: ColdStartMode = "refuse"
    at: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "crash_after_tokens":
            out.update(tokens=self.tokens, count=self.count)
        elif self.kind == "status_burst":
            out.update(status=self.status, count=self.count)
            if self.retry_after is not None:
                out["retry_after"] = self.retry_after
        elif self.kind == "slowdown":
            out["factor"] = self.factor
        elif self.kind in ("hang", "restart", "cold_start"):
            if self.seconds is not None:
                out["cold_start_seconds" if self.kind == "restart" else "seconds"] = self.seconds
            if self.kind != "hang":
                out["mode"] = self.mode
        if self.at is not None:
            out["at"] = self.at
        return out


def _num(doc: Mapping[str, Any], key: str, default: float | None, *, minimum: float) -> Any:
    v = doc.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise FaultError(f"{key} must be a number")
    if v < minimum:
        raise FaultError(f"{key} must be >= {minimum}")
    return v


def parse_fault(doc: Any) -> FaultSpec:
    """A FaultSpec from its JSON form (module docstring); FaultError names the bad field."""
    if not isinstance(doc, Mapping):
        raise FaultError("a fault is a JSON object with a 'kind'")
    kind = doc.get("kind")
    if kind not in FAULT_KINDS:
        raise FaultError(f"kind must be one of {', '.join(FAULT_KINDS)}")
    at = _num(doc, "at", None, minimum=0)
    mode = doc.get("mode", "refuse")
    if mode not in ("refuse", "unavailable"):
        raise FaultError("mode must be 'refuse' or 'unavailable'")
    count = doc.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or (count < 1 and count != -1):
        raise FaultError("count must be a positive integer or -1 (every request)")
    if kind == "crash_after_tokens":
        tokens = _num(doc, "tokens", None, minimum=0)
        if tokens is None or int(tokens) != tokens:
            raise FaultError("crash_after_tokens needs an integer 'tokens'")
        return FaultSpec("crash_after_tokens", tokens=int(tokens), count=count, at=at)
    if kind == "status_burst":
        status = doc.get("status", 503)
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise FaultError("status must be an HTTP error status (400-599)")
        retry = _num(doc, "retry_after", None, minimum=0)
        return FaultSpec("status_burst", status=status, count=count, retry_after=retry, at=at)
    if kind == "slowdown":
        factor = _num(doc, "factor", None, minimum=1e-6)
        if factor is None:
            raise FaultError("slowdown needs a 'factor'")
        return FaultSpec("slowdown", factor=float(factor), at=at)
    if kind == "hang":
        return FaultSpec("hang", seconds=_num(doc, "seconds", None, minimum=0), at=at)
    if kind == "restart":
        secs = _num(doc, "cold_start_seconds", 0.0, minimum=0)
        return FaultSpec("restart", seconds=float(secs), mode=mode, at=at)
    if kind == "cold_start":
        secs = _num(doc, "seconds", None, minimum=0)
        if secs is None:
            raise FaultError("cold_start needs 'seconds'")
        return FaultSpec("cold_start", seconds=float(secs), mode=mode, at=at)
    return FaultSpec("clear", at=at)


@dataclass(frozen=True, slots=True)
class Rejection:
    status: int
    retry_after: float | None


class FaultState:
    """The request-facing faults in force (the GPU-facing ones live in EngineCore)."""

    __slots__ = ("_bursts", "_crashes", "loading_mode", "loading_until")

    def __init__(self) -> None:
        # [remaining, spec]; remaining -1 = forever.
        self._bursts: list[list[Any]] = []
        self._crashes: list[list[Any]] = []
        self.loading_until = 0.0
        self.loading_mode: ColdStartMode = "refuse"

    def add_request_fault(self, spec: FaultSpec) -> None:
        if spec.kind == "status_burst":
            self._bursts.append([spec.count, spec])
        elif spec.kind == "crash_after_tokens":
            self._crashes.append([spec.count, spec])
        else:
            raise ValueError(f"{spec.kind} is not a request fault")

    def start_loading(self, now: float, seconds: float, mode: ColdStartMode) -> None:
        self.loading_until = max(self.loading_until, now + seconds)
        self.loading_mode = mode

    def loading(self, now: float) -> bool:
        return now < self.loading_until

    def refusing(self, now: float) -> bool:
        """Loading in "refuse" mode: connections are refused (no request, no /metrics)."""
        return now < self.loading_until and self.loading_mode == "refuse"

    def clear(self) -> None:
        self._bursts.clear()
        self._crashes.clear()
        self.loading_until = 0.0

    @staticmethod
    def _take(queue: list[list[Any]]) -> FaultSpec | None:
        if not queue:
            return None
        entry = queue[0]
        spec: FaultSpec = entry[1]
        if entry[0] != -1:
            entry[0] -= 1
            if entry[0] == 0:
                queue.pop(0)
        return spec

    def take_rejection(self) -> Rejection | None:
        """Consume one status_burst slot for an arriving request, if any."""
        spec = self._take(self._bursts)
        return None if spec is None else Rejection(spec.status, spec.retry_after)

    def peek_crash(self) -> int | None:
        """Tokens after which a request's connection resets, while a crash is planned."""
        return self._crashes[0][1].tokens if self._crashes else None

    def stream_crash_due(self, n_out: int, finished: bool) -> int | None:
        """The planned reset's token count when a streamed request with `n_out` tokens
        must reset now: it reached the count and has more to say (one that ends exactly
        at the count ends cleanly). None otherwise. Both drivers ask this."""
        limit = self._crashes[0][1].tokens if self._crashes else None
        if limit is None or n_out < limit or (finished and n_out <= limit):
            return None
        return int(limit)

    def take_crash(self) -> int | None:
        """Consume one planned crash (when a request actually reaches its token count)."""
        spec = self._take(self._crashes)
        return None if spec is None else spec.tokens

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for remaining, spec in self._bursts + self._crashes:
            d = spec.to_json()
            d["remaining"] = remaining
            out.append(d)
        return out
