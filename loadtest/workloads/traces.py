"""Trace replay: Mooncake JSONL traces and Azure LLM inference CSV traces as planned requests.

Formats: Mooncake (kvcache-ai/Mooncake : FAST25-release/traces, README "Open source trace":
`timestamp` ms since the first request, `input_length`, `output_length`, `hash_ids` of
512-token prefix blocks) and Azure (Azure/AzurePublicDataset : AzureLLMInferenceDataset2023.md:
`TIMESTAMP,ContextTokens,GeneratedTokens`). The files themselves live in the shared traces
directory (see `traces_dir`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

from loadtest.workloads.request import PlannedRequest
from loadtest.workloads.text import MAX_BLOCK_ID, block_text, segment

TRACES_ENV = "MESHD_TRACES_DIR"
# loadtest/workloads/traces.py -> the repository root is two folders up; the shared data
# sits beside the repository (../shared/data/traces).
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACES_DIR = REPO_ROOT.parent / "shared" / "data" / "traces"
MOONCAKE_SYNTHETIC = "synthetic_trace.jsonl"
AZURE_CODE = "AzureLLMInferenceTrace_code.csv"
AZURE_CONV = "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_BLOCK_TOKENS = 512
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# 2023-11-16 18:17:03.9799600: fractions have up to 9 digits (7 in the published files,
# which datetime alone would round to 6).
_AZURE_TIME = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?")
_EPOCH = datetime(1970, 1, 1)
_ONE_SECOND = timedelta(seconds=1)


class TraceFormatError(ValueError):
    """A malformed trace row; the message starts with "source:line:"."""

    def __init__(self, source: str, line: int, reason: str) -> None:
        super().__init__(f"{source}:{line}: {reason}")
        self.source = source
        self.line = line
        self.reason = reason


def traces_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The traces directory: `override`, else $MESHD_TRACES_DIR, else ../shared/data/traces."""
    if override is not None:
        return Path(override)
    env = os.environ.get(TRACES_ENV)
    return Path(env) if env else DEFAULT_TRACES_DIR


def _check_scales(cap: int | None, time_scale: float, token_scale: float) -> None:
    if cap is not None and cap < 0:
        raise ValueError(f"cap must be >= 0 or None, got {cap}")
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be finite and > 0, got {time_scale}")
    if not (math.isfinite(token_scale) and token_scale > 0):
        raise ValueError(f"token_scale must be finite and > 0, got {token_scale}")


def _scaled(n: int, token_scale: float) -> int:
    return max(1, round(n * token_scale))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mooncake_row(obj: object, block_tokens: int) -> tuple[float, int, int, list[int]]:
    """(timestamp_ms, input_length, output_length, hash_ids); ValueError(reason) if malformed."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise ValueError(f"missing field {key!r}")
    ts = obj["timestamp"]
    # A huge JSON integer is finite but has no float: check floats for inf/nan only.
    if (
        isinstance(ts, bool)
        or not isinstance(ts, int | float)
        or (isinstance(ts, float) and not math.isfinite(ts))
        or ts < 0
    ):
        raise ValueError(f"timestamp must be a number of ms >= 0, got {ts!r}")
    n_in, n_out, ids = obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not _is_int(n_in) or n_in < 1:
        raise ValueError(f"input_length must be an integer >= 1, got {n_in!r}")
    if not _is_int(n_out) or n_out < 0:
        raise ValueError(f"output_length must be an integer >= 0, got {n_out!r}")
    if not isinstance(ids, list) or not all(_is_int(h) and 0 <= h <= MAX_BLOCK_ID for h in ids):
        raise ValueError("hash_ids must be a list of integers in 0..2**63-1")
    expected = -(-n_in // block_tokens)
    if len(ids) != expected:
        raise ValueError(
            f"{len(ids)} hash_ids for input_length {n_in}: expected ceil({n_in}/{block_tokens})"
            f" = {expected}"
        )
    try:
        ts_ms = float(ts)
    except OverflowError:
        raise ValueError(f"timestamp {ts} is out of range") from None
    return ts_ms, n_in, n_out, ids


def parse_mooncake(
    lines: Iterable[str],
    source: str = "<mooncake>",
    cap: int | None = None,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    seed: int = 0,
    strict: bool = True,
    errors: list[str] | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[PlannedRequest]:
    """Planned requests from Mooncake trace lines; see `read_mooncake`."""
    _check_scales(cap, time_scale, token_scale)
    stem = Path(source).stem
    scaled_block = _scaled(block_tokens, token_scale)
    rows: list[tuple[int, float, int, int, list[int]]] = []
    for lineno, line in enumerate(lines, start=1):
        if cap is not None and len(rows) >= cap:
            break
        if not line.strip():
            continue
        try:
            rows.append((lineno, *_mooncake_row(json.loads(line), block_tokens)))
        # json.JSONDecodeError is a ValueError; absurdly deep nesting is a RecursionError.
        except (ValueError, RecursionError) as exc:
            error = TraceFormatError(source, lineno, str(exc))
            if strict:
                raise error from None
            if errors is not None:
                errors.append(str(error))
    origin = min((r[1] for r in rows), default=0.0)
    texts: dict[tuple[int, int], str] = {}  # shared blocks are built once
    out: list[PlannedRequest] = []
    for lineno, ts, n_in, n_out, ids in rows:
        last = n_in - block_tokens * (len(ids) - 1)
        lengths = [scaled_block] * (len(ids) - 1) + [min(scaled_block, _scaled(last, token_scale))]
        parts = []
        for bid, length in zip(ids, lengths, strict=True):
            key = (bid, length)
            if key not in texts:
                texts[key] = block_text(bid, length, seed)
            parts.append(texts[key])
        out.append(
            PlannedRequest(
                request_id=f"{stem}:{lineno}",
                workload=stem,
                at_s=(ts - origin) / 1000.0 / time_scale,
                kind="completion",
                prompt=" ".join(parts),
                messages=None,
                max_tokens=_scaled(n_out, token_scale),
                prompt_tokens=sum(lengths),
                block_ids=tuple(ids),
            )
        )
    out.sort(key=lambda r: r.at_s)
    return out


def read_mooncake(
    path: str | os.PathLike[str],
    cap: int | None = None,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    seed: int = 0,
    strict: bool = True,
    errors: list[str] | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[PlannedRequest]:
    """Replay a Mooncake JSONL trace.

    - at_s = (timestamp - earliest timestamp) / 1000 / time_scale: time_scale 2.0 replays
      twice as fast (halves every gap), 0.5 half as fast.
    - Each hash id is a block of `block_tokens` tokens (the format's 512); the last block is
      partial: input_length - block_tokens * (len(hash_ids) - 1) tokens. Block text is
      `block_text(hash_id, n, seed)`, so equal hash ids give identical text and requests with
      equal leading hash ids share a text prefix.
    - token_scale shrinks every block and the output alike (block of round(512 * scale)
      tokens, partial block and max_tokens = round(n * scale), each at least 1), keeping the
      sharing structure and so the hit-rate bounds; 1.0 replays exact lengths.
    - cap: keep only the first `cap` valid rows of the file.
    - A malformed row raises TraceFormatError ("file:line: reason"); with strict=False it
      is skipped and its message appended to `errors` when given (len(errors) = skipped).
    Requests are sorted by at_s (stable: file order among equal timestamps).
    """
    with open(path, encoding="utf-8") as f:
        return parse_mooncake(
            f, str(path), cap, time_scale, token_scale, seed, strict, errors, block_tokens
        )


def _azure_time_ns(text: str) -> int:
    m = _AZURE_TIME.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"TIMESTAMP {text!r} is not like 2023-11-16 18:17:03.9799600")
    try:
        whole = datetime.fromisoformat(m.group(1))
    except ValueError as exc:
        raise ValueError(f"TIMESTAMP {text!r}: {exc}") from None
    # Integer nanoseconds keep all 7 published digits; offsets come out exact.
    seconds = (whole - _EPOCH) // _ONE_SECOND
    fraction = m.group(2) or "0"
    return seconds * 1_000_000_000 + int(fraction.ljust(9, "0"))


def _azure_int(text: str, name: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{name} {text!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def parse_azure(
    lines: Iterable[str],
    source: str = "<azure>",
    cap: int | None = None,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    seed: int = 0,
    strict: bool = True,
    errors: list[str] | None = None,
) -> list[PlannedRequest]:
    """Planned requests from Azure trace CSV lines; see `read_azure`."""
    _check_scales(cap, time_scale, token_scale)
    stem = Path(source).stem
    rows: list[tuple[int, int, int, int]] = []
    header_seen = False
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.rstrip("\r\n").split(",")
        if not header_seen:
            # A wrong header means a wrong file: never skipped.
            if tuple(f.strip() for f in fields) != AZURE_HEADER:
                raise TraceFormatError(source, lineno, f"expected header {','.join(AZURE_HEADER)}")
            header_seen = True
            continue
        if cap is not None and len(rows) >= cap:
            break
        try:
            if len(fields) != 3:
                raise ValueError(f"expected 3 comma-separated fields, got {len(fields)}")
            rows.append(
                (
                    lineno,
                    _azure_time_ns(fields[0]),
                    _azure_int(fields[1], "ContextTokens", 1),
                    _azure_int(fields[2], "GeneratedTokens", 0),
                )
            )
        except ValueError as exc:
            error = TraceFormatError(source, lineno, str(exc))
            if strict:
                raise error from None
            if errors is not None:
                errors.append(str(error))
    if not header_seen:
        raise TraceFormatError(source, 1, f"missing header {','.join(AZURE_HEADER)}")
    origin = min((r[1] for r in rows), default=0)
    block = _scaled(MOONCAKE_BLOCK_TOKENS, token_scale)
    out: list[PlannedRequest] = []
    for lineno, ns, context, generated in rows:
        n_tokens = _scaled(context, token_scale)
        # No prefix information: every request gets text of its own.
        prompt, ids = segment(("azure", stem, seed, lineno), n_tokens, block)
        out.append(
            PlannedRequest(
                request_id=f"{stem}:{lineno}",
                workload=stem,
                at_s=(ns - origin) / 1e9 / time_scale,
                kind="completion",
                prompt=prompt,
                messages=None,
                max_tokens=_scaled(generated, token_scale),
                prompt_tokens=n_tokens,
                block_ids=ids,
            )
        )
    out.sort(key=lambda r: r.at_s)
    return out


def read_azure(
    path: str | os.PathLike[str],
    cap: int | None = None,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    seed: int = 0,
    strict: bool = True,
    errors: list[str] | None = None,
) -> list[PlannedRequest]:
    """Replay an Azure LLM inference trace (CSV `TIMESTAMP,ContextTokens,GeneratedTokens`).

    - at_s = (TIMESTAMP - earliest TIMESTAMP) / time_scale, exact to the nanosecond; 2.0
      replays twice as fast.
    - The trace has no prefix information, so every request gets unique text of
      round(ContextTokens * token_scale) tokens (block ids unique per row, in blocks of
      round(512 * token_scale)); max_tokens = round(GeneratedTokens * token_scale); each
      at least 1.
    - cap, strict and errors as in `read_mooncake`; a missing or wrong header always raises.
      A missing newline at the end of the file (as in the published files) is fine.
    """
    with open(path, encoding="utf-8", newline="") as f:
        return parse_azure(f, str(path), cap, time_scale, token_scale, seed, strict, errors)


def mooncake_sessions(
    requests: Iterable[PlannedRequest],
    *,
    think_s: float = 2.0,
    max_steps: int = 8,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[PlannedRequest]:
    """The conversations of a Mooncake replay (`read_mooncake`'s requests, in time order)
    as closed-loop sessions: each next step is sent `think_s` after the previous answer.

    How a conversation is found: request j continues request i (earlier, not yet
    continued) when j's hash ids start with all of i's full blocks (every id but i's last,
    possibly partial one) and at least one block; the longest such i wins. Its step then
    carries only j's blocks past i's (the runner sends i's prompt + i's answer + them),
    so the engine sees what a chat client sends: the whole history, then the new turn. A
    chain longer than `max_steps` starts a new session with its whole prompt. The first
    step keeps its trace arrival; later ones keep only their order. `session_id` names the
    chain (`step`, `steps_in_task` set); the client may withhold it (ClientSettings.
    context_headers) so that the router must find the session from the prompt alone.
    """
    if max_steps < 1 or not (math.isfinite(think_s) and think_s >= 0):
        raise ValueError("max_steps must be >= 1 and think_s finite and >= 0")
    reqs = sorted(requests, key=lambda r: r.at_s)
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    # Chained keys of each request's id prefixes: keys[L] names ids[:L].
    by_key: dict[int, int] = {}  # key of a request's full-block prefix -> its index
    parent: list[int | None] = [None] * len(reqs)
    cut: list[int] = [0] * len(reqs)  # blocks of the parent's that the child skips
    depth: list[int] = [0] * len(reqs)
    for j, r in enumerate(reqs):
        ids = r.block_ids
        keys = [0]
        for b in ids:
            keys.append(hash((keys[-1], b)))
        for length in range(len(ids) - 1, 0, -1):
            i = by_key.pop(keys[length], None)
            if i is None:
                continue
            if depth[i] + 1 < max_steps:
                parent[j], cut[j], depth[j] = i, len(reqs[i].block_ids), depth[i] + 1
            break
        if len(ids) > 1:
            by_key[keys[len(ids) - 1]] = j
    # Chains, from each root, and the blocks each step adds.
    children: dict[int, int] = {p: j for j, p in enumerate(parent) if p is not None}
    out: list[PlannedRequest] = []
    for root, r in enumerate(reqs):
        if parent[root] is not None:
            continue
        chain = [root]
        while chain[-1] in children:
            chain.append(children[chain[-1]])
        sid = f"session-{r.request_id}"
        at = r.at_s
        for step, j in enumerate(chain):
            q = reqs[j]
            if step == 0:
                out.append(replace(q, session_id=sid, step=0, steps_in_task=len(chain)))
                continue
            # The new turn: q's text past its parent's blocks (blocks are joined by single
            # spaces, one block a segment).
            skip = min(cut[j], len(q.block_ids) - 1)
            assert q.prompt is not None
            # A block is block_tokens words (the last may be shorter), one token a word.
            words = q.prompt.split(" ")[skip * block_tokens :]
            text = " ".join(words)
            at += think_s
            out.append(
                replace(
                    q,
                    at_s=at,
                    prompt=text,
                    prompt_tokens=len(words),
                    session_id=sid,
                    step=step,
                    steps_in_task=len(chain),
                    depends_on_previous=True,
                    think_s=think_s,
                    block_ids=reqs[chain[step - 1]].block_ids + q.block_ids[skip:],
                )
            )
    out.sort(key=lambda r: r.at_s)
    return out


def first_sessions(requests: Sequence[PlannedRequest], n: int) -> list[PlannedRequest]:
    """Whole sessions of `requests` (mooncake_sessions' output), in the order their first
    steps arrive, until they hold at least `n` requests (at least one session). A trace's
    next turn often comes minutes of trace time after the one it continues, so sessions
    found in a whole trace and cut this way keep their follow-ups, where sessions found in
    the trace's first `n` rows lose most of theirs (Mooncake: 1,303 follow-ups in 3,993
    rows; 49 in the first 1,000)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    sizes: dict[str | None, int] = {}
    for r in sorted(requests, key=lambda r: r.at_s):
        if r.step in (None, 0):
            sizes[r.session_id] = r.steps_in_task or 1
    keep: set[str | None] = set()
    total = 0
    for sid, size in sizes.items():
        if total >= n:
            break
        keep.add(sid)
        total += size
    return [r for r in requests if r.session_id in keep]
