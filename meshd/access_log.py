"""The JSON-lines access log: one record per client request (ids, tenant, model, endpoint, GPU,
tokens, timings, attempts, outcome, cost), a writer that never blocks the event loop, and a
reader. Every field is documented in docs/access-log.md; `meshd cost` reads these files.

The writer hands records to a bounded queue drained by one thread (which serialises, writes
through a buffer, flushes every `flush_interval_s` and rotates by size); when the queue is
full the record is dropped and counted, so a slow disk costs log lines, never latency.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("meshd.access_log")

__all__ = [
    "DEFAULT_FLUSH_INTERVAL_S",
    "DEFAULT_QUEUE_SIZE",
    "SCHEMA_VERSION",
    "AccessLogError",
    "AccessLogWriter",
    "AccessRecord",
    "AttemptRecord",
    "parse_access_log",
    "read_access_log",
]

SCHEMA_VERSION = 1
# Records waiting for the writer thread: ~1 s of a busy sidecar's traffic at 10k req/s would
# not fit, but 10k records at ~1 KiB each is ~10 MiB, the memory we allow a stalled disk.
DEFAULT_QUEUE_SIZE = 10_000
DEFAULT_FLUSH_INTERVAL_S = 1.0
# One line longer than this is not a record (guards the reader against a garbage file).
MAX_LINE_BYTES = 1 << 20


class AccessLogError(ValueError):
    """A malformed access-log line; the message starts with "source:line:"."""

    def __init__(self, source: str, line: int, reason: str) -> None:
        super().__init__(f"{source}:{line}: {reason}")
        self.source = source
        self.line = line
        self.reason = reason


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One upstream try of a request. outcome: ok, connect_error, timeout, http_<status>,
    upstream_error, stream_broken, stream_truncated, client_disconnect."""

    endpoint: str
    outcome: str
    reason: str = ""
    gpu: str | None = None
    completion_tokens: int | None = None  # tokens this attempt generated (failover splits)
    cached_tokens: int | None = None
    # The engine's: reported for the request (ORCA request_cost), or its measured busy time
    # apportioned (gpu_seconds_source "measured"); None: the ledger's timing model.
    gpu_seconds: float | None = None
    ttft_s: float | None = None
    # A split request's decode leg: the predicted seconds of the prompt's KV transfer.
    kv_transfer_s: float | None = None
    gpu_seconds_source: str | None = None  # reported | measured, with gpu_seconds

    # A log does not say when a try began or ended (filters/cost_ledger.py AttemptLike).
    @property
    def started_ts(self) -> float | None:
        return None

    @property
    def first_token_ts(self) -> float | None:
        return None

    @property
    def ended_ts(self) -> float | None:
        return None

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _ATTEMPT_FIELDS}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> AttemptRecord:
        return cls(
            endpoint=_str(obj, "endpoint"),
            outcome=_str(obj, "outcome"),
            reason=_opt_str(obj, "reason") or "",
            gpu=_opt_str(obj, "gpu"),
            completion_tokens=_opt_int(obj, "completion_tokens"),
            cached_tokens=_opt_int(obj, "cached_tokens"),
            gpu_seconds=_opt_float(obj, "gpu_seconds"),
            ttft_s=_opt_float(obj, "ttft_s"),
            kv_transfer_s=_opt_float(obj, "kv_transfer_s"),
            gpu_seconds_source=_opt_str(obj, "gpu_seconds_source"),
        )


@dataclass(frozen=True, slots=True)
class AccessRecord:
    """One client request, written when its response is finished (see docs/access-log.md)."""

    ts: float  # Unix time (s) when the request arrived
    request_id: str
    outcome: str  # ok | client_disconnect | an error code (upstream_timeout, ...)
    status: int = 0  # HTTP status sent to the client (0: none sent)
    trace_id: str | None = None
    tenant: str | None = None
    model: str | None = None
    task_id: str | None = None
    workflow_id: str | None = None
    session_id: str | None = None
    step: int | None = None  # 0-based index in its task
    steps_in_task: int | None = None
    final: bool | None = None  # the client said this is its task's last step
    pool: str | None = None
    endpoint: str | None = None  # the endpoint of the final attempt
    gpu: str | None = None  # its GPU generation
    kind: str | None = None  # chat | completion | embedding | other
    stream: bool = False
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    attempts: tuple[AttemptRecord, ...] = ()
    cost_usd: float | None = None
    gpu_seconds: float | None = None
    gpu_seconds_source: str | None = None  # reported | estimated
    priority: int | None = None
    deadline_ms: int | None = None
    predicted_cached_tokens: int | None = None
    pick_reason: str | None = None  # why the picker chose the first endpoint tried
    affinity_departure: str | None = None  # why it left the prefix's holder, if it did
    fallback_from: str | None = None  # the pool it left for its fallback (`pool` served it)
    fallback_reason: str | None = None  # why: no_healthy_upstream, overloaded, over_cost_cap...
    pd: str | None = None  # decode pool: split (prefill step elsewhere) or whole:<why>
    response_cache: str | None = None  # hit | coalesced | miss | refresh (null: not cacheable)
    avoided_gpu_seconds: float | None = None  # a hit: what the engine spent on the answer
    avoided_usd: float | None = None
    v: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _RECORD_FIELDS:
            value = getattr(self, name)
            if name == "attempts":
                value = [a.to_json() for a in value]
            elif value.__class__ is float:
                value = round(value, 9)
            out[name] = value
        return out

    def to_line(self) -> str:
        return _ENCODER.encode(self.to_json()) + "\n"

    @classmethod
    def from_json(cls, obj: Any) -> AccessRecord:
        """Raises ValueError (the reason) for a malformed record; unknown keys are ignored
        so that a newer writer's log stays readable."""
        if not isinstance(obj, dict):
            raise ValueError("expected a JSON object")
        ts = _opt_float(obj, "ts")
        if ts is None:
            raise ValueError("missing field 'ts'")
        raw_attempts = obj.get("attempts") or []
        if not isinstance(raw_attempts, list) or not all(isinstance(a, dict) for a in raw_attempts):
            raise ValueError("attempts must be a list of objects")
        stream = obj.get("stream", False)
        final = obj.get("final")
        if not isinstance(stream, bool) or not (final is None or isinstance(final, bool)):
            raise ValueError("stream and final must be booleans")
        return cls(
            ts=ts,
            request_id=_str(obj, "request_id"),
            outcome=_str(obj, "outcome"),
            status=_opt_int(obj, "status") or 0,
            trace_id=_opt_str(obj, "trace_id"),
            tenant=_opt_str(obj, "tenant"),
            model=_opt_str(obj, "model"),
            task_id=_opt_str(obj, "task_id"),
            workflow_id=_opt_str(obj, "workflow_id"),
            session_id=_opt_str(obj, "session_id"),
            step=_opt_int(obj, "step"),
            steps_in_task=_opt_int(obj, "steps_in_task"),
            final=final,
            pool=_opt_str(obj, "pool"),
            endpoint=_opt_str(obj, "endpoint"),
            gpu=_opt_str(obj, "gpu"),
            kind=_opt_str(obj, "kind"),
            stream=stream,
            prompt_tokens=_opt_int(obj, "prompt_tokens"),
            cached_tokens=_opt_int(obj, "cached_tokens"),
            completion_tokens=_opt_int(obj, "completion_tokens"),
            ttft_s=_opt_float(obj, "ttft_s"),
            e2e_s=_opt_float(obj, "e2e_s"),
            queue_s=_opt_float(obj, "queue_s"),
            attempts=tuple(AttemptRecord.from_json(a) for a in raw_attempts),
            cost_usd=_opt_float(obj, "cost_usd"),
            gpu_seconds=_opt_float(obj, "gpu_seconds"),
            gpu_seconds_source=_opt_str(obj, "gpu_seconds_source"),
            priority=_opt_int(obj, "priority"),
            deadline_ms=_opt_int(obj, "deadline_ms"),
            predicted_cached_tokens=_opt_int(obj, "predicted_cached_tokens"),
            pick_reason=_opt_str(obj, "pick_reason"),
            affinity_departure=_opt_str(obj, "affinity_departure"),
            fallback_from=_opt_str(obj, "fallback_from"),
            fallback_reason=_opt_str(obj, "fallback_reason"),
            pd=_opt_str(obj, "pd"),
            response_cache=_opt_str(obj, "response_cache"),
            avoided_gpu_seconds=_opt_float(obj, "avoided_gpu_seconds"),
            avoided_usd=_opt_float(obj, "avoided_usd"),
            v=_opt_int(obj, "v") or SCHEMA_VERSION,
        )


_ATTEMPT_FIELDS = tuple(f.name for f in fields(AttemptRecord))
_RECORD_FIELDS = tuple(f.name for f in fields(AccessRecord))
# One encoder: json.dumps with non-default options builds a new one per call (~2x slower).
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def _str(obj: Mapping[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {value!r}")
    return value


def _opt_str(obj: Mapping[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a string or null, got {value!r}")
    return value


def _opt_int(obj: Mapping[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer or null, got {value!r}")
    return value


def _opt_float(obj: Mapping[str, Any], key: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number or null, got {value!r}")
    try:
        out = float(value)
    except OverflowError:
        raise ValueError(f"{key} is out of range") from None
    if not math.isfinite(out):
        raise ValueError(f"{key} must be finite")
    return out


def parse_access_log(
    lines: Iterable[str],
    source: str = "<access-log>",
    *,
    strict: bool = True,
    errors: list[str] | None = None,
) -> Iterator[AccessRecord]:
    """Records from access-log lines. A malformed line raises AccessLogError; with
    strict=False it is skipped and its message appended to `errors` when given."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"line longer than {MAX_LINE_BYTES} bytes")
            yield AccessRecord.from_json(json.loads(line))
        except (ValueError, RecursionError) as exc:
            error = AccessLogError(source, lineno, str(exc))
            if strict:
                raise error from None
            if errors is not None:
                errors.append(str(error))


def read_access_log(
    path: str | os.PathLike[str], *, strict: bool = True, errors: list[str] | None = None
) -> Iterator[AccessRecord]:
    """Records of one access-log file (a rotated set: pass each file, oldest first)."""
    with open(path, encoding="utf-8") as f:
        yield from parse_access_log(f, str(path), strict=strict, errors=errors)


_STOP = object()


class AccessLogWriter:
    """Writes records to `path` from a background thread; `write` never blocks.

    max_bytes: rotate when the file would grow past it (path -> path.1 -> ... ->
    path.<backups>, the oldest removed); None never rotates. Call `close()` to flush and stop
    the thread (records queued before it are written). `dropped` counts records refused
    because the queue was full or the writer closed; `write_errors` counts failed writes.
    `start=False` leaves the thread unstarted until `start()` (tests fill the queue with it).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        max_bytes: int | None = None,
        backups: int = 5,
        start: bool = True,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups}")
        self.path = Path(path)
        self.flush_interval_s = flush_interval_s
        self.max_bytes = max_bytes
        self.backups = backups
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="meshd-access-log", daemon=True)
        self._closed = False
        self.dropped = 0
        self.written = 0
        self.write_errors = 0
        self.rotations = 0
        if start:
            self.start()

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def write(self, record: AccessRecord) -> bool:
        """Queue one record; False (and dropped += 1) when the queue is full or closed."""
        if self._closed:
            self.dropped += 1
            return False
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def close(self, timeout_s: float | None = 10.0) -> None:
        """Write what is queued, flush and stop the thread. Blocking: call it from a thread
        (`await loop.run_in_executor(None, writer.close)`) when the loop must stay live."""
        if self._closed:
            return
        self._closed = True
        self.start()
        self._queue.put(_STOP)  # blocks only until the thread makes room
        self._thread.join(timeout_s)

    # -- the thread -----------------------------------------------------------------

    def _open(self) -> IO[str]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.path, "a", encoding="utf-8", buffering=1 << 16)

    def _rotate(self, f: IO[str]) -> IO[str]:
        f.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self.rotations += 1
        return self._open()

    def _run(self) -> None:
        f = self._open()
        size = f.tell()
        try:
            while True:
                try:
                    item = self._queue.get(timeout=self.flush_interval_s)
                except queue.Empty:
                    f.flush()
                    continue
                if item is _STOP:
                    break
                assert isinstance(item, AccessRecord)
                try:
                    line = item.to_line()
                    n = len(line.encode())
                    if self.max_bytes is not None and size > 0 and size + n > self.max_bytes:
                        f = self._rotate(f)
                        size = 0
                    f.write(line)
                    size += n
                    self.written += 1
                except (OSError, ValueError) as exc:
                    self.write_errors += 1
                    log.warning("access log %s: could not write a record: %s", self.path, exc)
                if self._queue.empty():
                    f.flush()
        finally:
            f.close()
