"""Routing headers of one request: meshd's own `x-meshd-*` hints and W3C Trace Context.

Pure-Python reference; `filters/_routing_headers_c.pyx` is the compiled twin and must
return equal results for any input. Callers import `parse_routing_headers` from
`filters.hotpath`. At a trust boundary every `x-meshd-*` header is stripped unparsed.

Trace Context rules follow the W3C spec (w3c/trace-context: spec/20-http_request_header_format.md)
and its test suite (w3c/trace-context: test/test.py, test/tracecontext/tracestate.py):
a malformed `traceparent` is ignored, never an error; `tracestate` is kept only with a
valid `traceparent`, and is discarded whole when any list member is malformed.

Task steps (for cost per successful task, filters/cost_ledger.py): `x-meshd-task-step` is
the 0-based index of this request in its task (as the access log's `step`),
`x-meshd-task-steps` how many steps the task has, `x-meshd-task-final` (`true`/`false`,
or `1`/`0`) whether this is its last step. A step not below the step count is an error
(a 1-based client's last step is caught here). `final`, when sent, decides over the
count: an agent may finish early or add steps. They mean something only with a task or
workflow id; without one the request is a task of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DEADLINE_MS_MAX",
    "ID_MAX_CHARS",
    "PRIORITY_NAMES",
    "TASK_STEPS_MAX",
    "TRACESTATE_MAX_MEMBERS",
    "RoutingHeaders",
    "TraceContext",
    "parse_routing_headers",
]


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A valid W3C `traceparent` (and its `tracestate`, when that is valid too)."""

    trace_id: str  # 32 lowercase hex, not all zero
    parent_id: str  # 16 lowercase hex, not all zero
    flags: int  # trace-flags byte
    tracestate: str | None


@dataclass(frozen=True, slots=True)
class RoutingHeaders:
    """What the routing headers of one request say; None where a header is absent or bad."""

    tenant: str | None = None
    priority: int | None = None  # 0..9, higher is more important
    deadline_ms: int | None = None  # relative latency budget in milliseconds
    session_id: str | None = None
    workflow_id: str | None = None
    task_id: str | None = None
    step: int | None = None  # x-meshd-task-step: 0-based index of this request in its task
    steps_in_task: int | None = None  # x-meshd-task-steps: how many steps the task has
    final: bool | None = None  # x-meshd-task-final: this is the task's last step
    trace: TraceContext | None = None
    stripped: tuple[str, ...] = ()  # lower-cased names of x-meshd-* headers removed (untrusted)
    errors: tuple[str, ...] = ()  # human-readable problems, each naming the header


# Limits. A deadline beyond a day is a mistake, not a budget.
DEADLINE_MS_MAX = 86_400_000
ID_MAX_CHARS = 128
# Steps in one task: thousands for an autonomous workflow; a million is a mistake.
TASK_STEPS_MAX = 1_000_000
TRACESTATE_MAX_MEMBERS = 32  # W3C: "a maximum of 32 list-members"
# Longest value quoted back in an error message; the rest is elided.
ERROR_VALUE_MAX_CHARS = 64

PRIORITY_NAMES: dict[str, int] = {
    "critical": 9,
    "high": 7,
    "standard": 5,
    "low": 3,
    "sheddable": 0,
}

MESHD_PREFIX = "x-meshd-"
TENANT = "x-meshd-tenant"
PRIORITY = "x-meshd-priority"
DEADLINE = "x-meshd-deadline-ms"
SESSION = "x-meshd-session-id"
WORKFLOW = "x-meshd-workflow-id"
TASK = "x-meshd-task-id"
TASK_STEP = "x-meshd-task-step"
TASK_STEPS = "x-meshd-task-steps"
TASK_FINAL = "x-meshd-task-final"
KNOWN_MESHD = frozenset(
    (TENANT, PRIORITY, DEADLINE, SESSION, WORKFLOW, TASK, TASK_STEP, TASK_STEPS, TASK_FINAL)
)

# HTTP optional whitespace (RFC 9110 section 5.6.3): values and names are compared
# without it.
OWS = " \t"

ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:/@+=-")
LCHEX = frozenset("0123456789abcdef")

PRIORITY_EXPECTED = "expected an integer 0-9 or one of critical, high, standard, low, sheddable"
DEADLINE_EXPECTED = f"expected an integer 1-{DEADLINE_MS_MAX} (milliseconds)"
ID_EXPECTED = f"expected 1-{ID_MAX_CHARS} characters of A-Z a-z 0-9 . _ : / @ + = -"
STEP_EXPECTED = f"expected an integer 0-{TASK_STEPS_MAX - 1} (steps count from 0)"
STEPS_EXPECTED = f"expected an integer 1-{TASK_STEPS_MAX}"
FINAL_EXPECTED = "expected true or false (or 1 or 0)"
FINAL_VALUES: dict[str, bool] = {"true": True, "false": False, "1": True, "0": False}

# W3C tracestate list-member (Level 1 key grammar, as the spec's test suite checks it).
_TS_KEY = r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
_TS_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
TRACESTATE_MEMBER = re.compile(f"({_TS_KEY})=({_TS_VALUE})")

_EMPTY = RoutingHeaders()


def show(value: str) -> str:
    """A header value quoted for an error message, cut to a readable length."""
    if len(value) > ERROR_VALUE_MAX_CHARS:
        return repr(value[:ERROR_VALUE_MAX_CHARS]) + "..."
    return repr(value)


def repeated_error(name: str, count: int) -> str:
    return f"{name}: repeated header; send it once (got {count} values)"


def invalid_error(name: str, expected: str, value: str) -> str:
    return f"{name}: {expected}; got {show(value)}"


def parse_priority(v: str) -> int | None:
    if len(v) == 1 and "0" <= v <= "9":
        return ord(v) - 48
    return PRIORITY_NAMES.get(v.lower())


def parse_deadline(v: str) -> int | None:
    return parse_count(v, 1, DEADLINE_MS_MAX, max_digits=8)  # DEADLINE_MS_MAX: 8 digits


def parse_count(v: str, lo: int, hi: int, max_digits: int = 7) -> int | None:
    """A decimal integer in lo..hi (ASCII digits, leading zeros allowed, at most
    `max_digits` after them: that bounds int()'s work; TASK_STEPS_MAX has 7), else None."""
    if not (v.isascii() and v.isdigit()):
        return None
    digits = v.lstrip("0")
    if len(digits) > max_digits:
        return None
    n = int(digits) if digits else 0
    return n if lo <= n <= hi else None


def parse_final(v: str) -> bool | None:
    return FINAL_VALUES.get(v.lower()) if len(v) <= 5 else None


def step_error(step: int, steps: int) -> str:
    return (
        f"{TASK_STEP}: {step} is not below {TASK_STEPS} {steps} "
        f"(steps count from 0: the last of {steps} is {steps - 1})"
    )


def valid_id(v: str) -> bool:
    return 0 < len(v) <= ID_MAX_CHARS and ID_CHARS.issuperset(v)


def parse_traceparent(v: str) -> tuple[str, str, int] | None:
    """(trace_id, parent_id, flags) of a valid traceparent value, else None (ignore it)."""
    n = len(v)
    # Version 00 is exactly 55 characters; a higher version is at least that and is
    # parsed by its first four fields, which must be followed by the end or a dash.
    if n < 55 or v[2] != "-" or v[35] != "-" or v[52] != "-":
        return None
    version = v[0:2]
    if not LCHEX.issuperset(version) or version == "ff":
        return None
    if n > 55 and (version == "00" or v[55] != "-"):
        return None
    trace_id = v[3:35]
    parent_id = v[36:52]
    flags = v[53:55]
    if not (LCHEX.issuperset(trace_id) and LCHEX.issuperset(parent_id)):
        return None
    if not LCHEX.issuperset(flags):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return trace_id, parent_id, int(flags, 16)


def parse_tracestate(values: list[str]) -> str | None:
    """The combined tracestate (members joined by ","), or None if empty or invalid."""
    members: list[str] = []
    keys: set[str] = set()
    for value in values:
        for raw in value.split(","):
            member = raw.strip(OWS)
            if not member:
                continue  # empty and whitespace-only members are allowed
            m = TRACESTATE_MEMBER.fullmatch(member)
            if m is None:
                return None
            key = m.group(1)
            if key in keys or len(members) == TRACESTATE_MAX_MEMBERS:
                return None
            keys.add(key)
            members.append(member)
    return ",".join(members) if members else None


def build(
    seen: dict[str, list[str]],
    traceparents: list[str],
    tracestates: list[str],
    stripped: list[str],
) -> RoutingHeaders:
    """Turn the collected raw values into a RoutingHeaders (shared by both twins)."""
    errors: list[str] = []
    tenant = session_id = workflow_id = task_id = None
    priority = deadline_ms = step = steps = None
    final: bool | None = None
    for name, values in seen.items():
        if len(values) > 1:
            errors.append(repeated_error(name, len(values)))
            continue
        v = values[0].strip(OWS)
        if name == PRIORITY:
            priority = parse_priority(v)
            if priority is None:
                errors.append(invalid_error(name, PRIORITY_EXPECTED, v))
        elif name == DEADLINE:
            deadline_ms = parse_deadline(v)
            if deadline_ms is None:
                errors.append(invalid_error(name, DEADLINE_EXPECTED, v))
        elif name == TASK_STEP:
            step = parse_count(v, 0, TASK_STEPS_MAX - 1)
            if step is None:
                errors.append(invalid_error(name, STEP_EXPECTED, v))
        elif name == TASK_STEPS:
            steps = parse_count(v, 1, TASK_STEPS_MAX)
            if steps is None:
                errors.append(invalid_error(name, STEPS_EXPECTED, v))
        elif name == TASK_FINAL:
            final = parse_final(v)
            if final is None:
                errors.append(invalid_error(name, FINAL_EXPECTED, v))
        elif not valid_id(v):
            errors.append(invalid_error(name, ID_EXPECTED, v))
        elif name == TENANT:
            tenant = v
        elif name == SESSION:
            session_id = v
        elif name == WORKFLOW:
            workflow_id = v
        else:
            task_id = v
    if step is not None and steps is not None and step >= steps:
        errors.append(step_error(step, steps))
        step = None
    trace = None
    # Two traceparent headers are ambiguous: the W3C suite expects a restarted trace.
    if len(traceparents) == 1:
        parsed = parse_traceparent(traceparents[0].strip(OWS))
        if parsed is not None:
            ts = parse_tracestate(tracestates) if tracestates else None
            trace = TraceContext(parsed[0], parsed[1], parsed[2], ts)
    return RoutingHeaders(
        tenant=tenant,
        priority=priority,
        deadline_ms=deadline_ms,
        session_id=session_id,
        workflow_id=workflow_id,
        task_id=task_id,
        step=step,
        steps_in_task=steps,
        final=final,
        trace=trace,
        stripped=tuple(stripped),
        errors=tuple(errors),
    )


def parse_routing_headers(
    headers: Iterable[tuple[str, str]], trusted: bool
) -> tuple[RoutingHeaders, list[tuple[str, str]]]:
    """Parse routing headers; return them and the headers to forward upstream.

    Names match case-insensitively (and without surrounding spaces/tabs). When `trusted`
    is false every `x-meshd-*` header is removed from the forwarded list, named in
    `stripped`, and not parsed. When trusted, known meshd headers are parsed (a malformed
    or repeated one yields an entry in `errors` and leaves its field None) and all headers,
    unknown `x-meshd-*` ones included, are forwarded. `traceparent`/`tracestate` are parsed
    in both modes and always forwarded unchanged. Order of the input is kept.
    Raises TypeError when a name or value is not a str.
    """
    forward: list[tuple[str, str]] = []
    stripped: list[str] = []
    seen: dict[str, list[str]] = {}
    traceparents: list[str] = []
    tracestates: list[str] = []
    for name, value in headers:
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError("header names and values must be str")
        key = name.strip(OWS).lower()
        if key.startswith(MESHD_PREFIX):
            if not trusted:
                stripped.append(key)
                continue
            if key in KNOWN_MESHD:
                vals = seen.get(key)
                if vals is None:
                    seen[key] = [value]
                else:
                    vals.append(value)
        elif key == "traceparent":
            traceparents.append(value)
        elif key == "tracestate":
            tracestates.append(value)
        forward.append((name, value))
    if not (seen or traceparents or stripped):
        return _EMPTY, forward
    return build(seen, traceparents, tracestates, stripped), forward
