"""meshd/access_log.py: records round-trip, a full queue drops without blocking, rotation,
and the reader accepts every record the writer can write and rejects bad lines by line."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.access_log import (
    AccessLogError,
    AccessLogWriter,
    AccessRecord,
    AttemptRecord,
    parse_access_log,
    read_access_log,
)

FULL = AccessRecord(
    ts=1_700_000_000.25,
    request_id="r1",
    outcome="ok",
    status=200,
    trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
    tenant="acme",
    model="llama",
    task_id="T",
    workflow_id="W",
    session_id="S",
    step=2,
    steps_in_task=5,
    final=False,
    pool="default",
    endpoint="http://b:8000",
    gpu="H100",
    kind="chat",
    stream=True,
    prompt_tokens=600,
    cached_tokens=512,
    completion_tokens=64,
    ttft_s=0.07,
    e2e_s=1.5,
    queue_s=0.01,
    attempts=(
        AttemptRecord("http://a:8000", "connect_error", "refused", gpu="A100"),
        AttemptRecord("http://b:8000", "ok", gpu="H100", completion_tokens=64, gpu_seconds=0.4),
    ),
    cost_usd=0.0004,
    gpu_seconds=0.4,
    gpu_seconds_source="reported",
    priority=7,
    deadline_ms=5000,
    predicted_cached_tokens=512,
)


def test_round_trip_through_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "access.jsonl"
    writer = AccessLogWriter(path, flush_interval_s=0.05)
    minimal = AccessRecord(ts=1.0, request_id="r2", outcome="upstream_timeout", status=504)
    assert writer.write(FULL) and writer.write(minimal)
    writer.close()
    assert writer.written == 2 and writer.dropped == 0
    assert list(read_access_log(path)) == [FULL, minimal]
    first = json.loads(path.read_text().splitlines()[0])
    assert first["attempts"][0] == {
        "endpoint": "http://a:8000",
        "outcome": "connect_error",
        "reason": "refused",
        "gpu": "A100",
        "completion_tokens": None,
        "cached_tokens": None,
        "gpu_seconds": None,
        "ttft_s": None,
        "kv_transfer_s": None,
        "gpu_seconds_source": None,
    }


def test_full_queue_drops_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "access.jsonl"
    # The thread is not running yet: nothing drains the queue, as with a stalled disk.
    writer = AccessLogWriter(path, queue_size=3, start=False)
    t0 = time.monotonic()
    results = [writer.write(FULL) for _ in range(5)]
    assert time.monotonic() - t0 < 0.5  # never waits for room
    assert results == [True, True, True, False, False]
    assert writer.dropped == 2 and writer.queued == 3
    writer.close()
    assert len(list(read_access_log(path))) == 3
    assert writer.write(FULL) is False and writer.dropped == 3  # closed: refused, counted


def test_rotation_by_size(tmp_path: Path) -> None:
    path = tmp_path / "access.jsonl"
    line = len(FULL.to_line().encode())
    writer = AccessLogWriter(path, max_bytes=2 * line + 1, backups=2)
    for i in range(7):
        writer.write(replace(FULL, request_id=f"r{i}"))
    writer.close()
    files = [path.with_name("access.jsonl.2"), path.with_name("access.jsonl.1"), path]
    ids = [[r.request_id for r in read_access_log(f)] for f in files]
    # Two records a file; the oldest file (r0, r1) fell off the end of two backups.
    assert ids == [["r2", "r3"], ["r4", "r5"], ["r6"]]
    assert writer.rotations == 3


def test_bad_lines_name_their_line() -> None:
    lines = [FULL.to_line(), "not json\n", "\n", '{"ts": 1, "request_id": 5, "outcome": "ok"}\n']
    with pytest.raises(AccessLogError, match=r"^f:2:"):
        list(parse_access_log(lines, "f"))
    errors: list[str] = []
    assert list(parse_access_log(lines, "f", strict=False, errors=errors)) == [FULL]
    assert [e.split(":")[1] for e in errors] == ["2", "4"]


_text = st.text(max_size=20)
_opt_int = st.none() | st.integers(min_value=0, max_value=2**40)
_opt_float = st.none() | st.floats(min_value=0, max_value=1e9, allow_nan=False)
_attempt = st.builds(
    AttemptRecord,
    endpoint=_text,
    outcome=_text,
    reason=_text,
    gpu=st.none() | _text,
    completion_tokens=_opt_int,
    gpu_seconds=_opt_float,
)


@given(
    st.builds(
        AccessRecord,
        ts=st.floats(min_value=0, max_value=4e9, allow_nan=False),
        request_id=_text,
        outcome=_text,
        tenant=st.none() | _text,
        step=_opt_int,
        final=st.none() | st.booleans(),
        stream=st.booleans(),
        prompt_tokens=_opt_int,
        e2e_s=_opt_float,
        attempts=st.lists(_attempt, max_size=3).map(tuple),
    )
)
def test_property_every_written_record_reads_back(record: AccessRecord) -> None:
    (back,) = parse_access_log([record.to_line()])
    # Floats are written rounded to 1e-9.
    assert back.to_json() == record.to_json()


@given(st.text(max_size=200))
def test_property_any_line_is_a_record_or_the_one_error(line: str) -> None:
    with contextlib.suppress(AccessLogError):
        list(parse_access_log([line]))
