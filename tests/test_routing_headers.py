"""Routing headers: each x-meshd header, the trust boundary, W3C Trace Context cases (from
w3c/trace-context test/test.py), and the compiled twin equal to the reference on any input."""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters import routing_headers as pure
from filters.routing_headers import RoutingHeaders, TraceContext

compiled: types.ModuleType | None
try:
    compiled = importlib.import_module("filters._routing_headers_c")
except ImportError:  # pragma: no cover - depends on the build
    compiled = None

NOT_BUILT = "compiled twin filters._routing_headers_c not built (run setup.py build_ext --inplace)"
IMPLS = [
    pytest.param(pure, id="pure"),
    pytest.param(
        compiled, id="cython", marks=pytest.mark.skipif(compiled is None, reason=NOT_BUILT)
    ),
]
needs_compiled = pytest.mark.skipif(compiled is None, reason=NOT_BUILT)

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"

Headers = list[tuple[str, str]]
Parse = Callable[[Iterable[Any], bool], tuple[RoutingHeaders, Headers]]


@pytest.fixture(params=IMPLS)
def parse(request: pytest.FixtureRequest) -> Parse:
    impl: types.ModuleType = request.param
    return impl.parse_routing_headers


def rh(parse: Parse, headers: Headers, trusted: bool = True) -> RoutingHeaders:
    return parse(headers, trusted)[0]


# --- x-meshd-* values -------------------------------------------------------------------


def test_all_fields(parse: Parse) -> None:
    headers = [
        ("x-meshd-task-step", "2"),
        ("X-Meshd-Task-Steps", "5"),
        ("x-meshd-task-final", "false"),
        ("Host", "engine:8000"),
        ("X-Meshd-Tenant", "acme"),
        ("x-meshd-priority", "7"),
        ("X-MESHD-DEADLINE-MS", "2500"),
        ("x-meshd-session-id", "sess-1"),
        ("x-meshd-workflow-id", "wf/2024:a@b+c=d"),
        ("x-meshd-task-id", "t.1_2-3"),
        ("traceparent", TP),
        ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
    ]
    r, fwd = parse(headers, True)
    assert r == RoutingHeaders(
        tenant="acme",
        priority=7,
        deadline_ms=2500,
        session_id="sess-1",
        workflow_id="wf/2024:a@b+c=d",
        task_id="t.1_2-3",
        step=2,
        steps_in_task=5,
        final=False,
        trace=TraceContext(TRACE_ID, PARENT_ID, 1, "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
    )
    assert fwd == headers  # trusted: everything is forwarded, in order


def test_no_routing_headers(parse: Parse) -> None:
    headers = [("Content-Type", "application/json"), ("Accept", "*/*")]
    r, fwd = parse(headers, False)
    assert r == RoutingHeaders()
    assert fwd == headers


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0),
        ("9", 9),
        ("5", 5),
        (" 3\t", 3),
        ("critical", 9),
        ("high", 7),
        ("standard", 5),
        ("low", 3),
        ("sheddable", 0),
        ("HIGH", 7),
        ("Sheddable", 0),
    ],
)
def test_priority_valid(parse: Parse, value: str, expected: int) -> None:
    r = rh(parse, [("x-meshd-priority", value)])
    assert r.priority == expected
    assert r.errors == ()


@pytest.mark.parametrize("value", ["abc", "", "10", "-1", "+5", "07", "5.0", "٣", "medium", "1 2"])
def test_priority_invalid(parse: Parse, value: str) -> None:
    r = rh(parse, [("x-meshd-priority", value)])
    assert r.priority is None
    shown = repr(value.strip(" \t"))
    assert r.errors == (
        "x-meshd-priority: expected an integer 0-9 or one of critical, high, standard, low, "
        f"sheddable; got {shown}",
    )


def test_priority_error_message_exact(parse: Parse) -> None:
    assert rh(parse, [("X-Meshd-Priority", "abc")]).errors == (
        "x-meshd-priority: expected an integer 0-9 or one of critical, high, standard, low, "
        "sheddable; got 'abc'",
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", 1), ("2500", 2500), ("86400000", 86_400_000), ("0000000000042", 42), (" 10 ", 10)],
)
def test_deadline_valid(parse: Parse, value: str, expected: int) -> None:
    r = rh(parse, [("x-meshd-deadline-ms", value)])
    assert r.deadline_ms == expected
    assert r.errors == ()


@pytest.mark.parametrize(
    "value", ["0", "86400001", "999999999999999999999", "-5", "1.5", "1e3", "", "٣", "5 ms"]
)
def test_deadline_invalid(parse: Parse, value: str) -> None:
    r = rh(parse, [("x-meshd-deadline-ms", value)])
    assert r.deadline_ms is None
    assert len(r.errors) == 1
    assert r.errors[0].startswith("x-meshd-deadline-ms: expected an integer 1-86400000")
    assert r.errors[0].endswith(f"got {value.strip()!r}")


@pytest.mark.parametrize(
    "name", ["x-meshd-tenant", "x-meshd-session-id", "x-meshd-workflow-id", "x-meshd-task-id"]
)
@pytest.mark.parametrize("value", ["a", "A-Z.a_z:0/9@+=-", "x" * 128])
def test_ids_valid(parse: Parse, name: str, value: str) -> None:
    r = rh(parse, [(name, value)])
    field = name.removeprefix("x-meshd-").replace("-", "_")
    assert getattr(r, field) == value
    assert r.errors == ()


@pytest.mark.parametrize(
    "name", ["x-meshd-tenant", "x-meshd-session-id", "x-meshd-workflow-id", "x-meshd-task-id"]
)
@pytest.mark.parametrize("value", ["", "x" * 129, "a b", "é", "a,b", "a;b", "a\x00"])
def test_ids_invalid(parse: Parse, name: str, value: str) -> None:
    r = rh(parse, [(name, value)])
    field = name.removeprefix("x-meshd-").replace("-", "_")
    assert getattr(r, field) is None
    assert len(r.errors) == 1
    assert r.errors[0].startswith(f"{name}: expected 1-128 characters of A-Z a-z 0-9")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", 0), ("4", 4), (" 17\t", 17), ("000", 0), ("0000000000003", 3), ("999999", 999_999)],
)
def test_task_step_valid(parse: Parse, value: str, expected: int) -> None:
    r = rh(parse, [("x-meshd-task-step", value)])
    assert (r.step, r.errors) == (expected, ())


@pytest.mark.parametrize(
    "value", ["", "-1", "+1", "1.0", "1e3", "٣", "one", "1000000", "99999999999999999999", "1 2"]
)
def test_task_step_invalid(parse: Parse, value: str) -> None:
    r = rh(parse, [("x-meshd-task-step", value)])
    assert r.step is None
    assert r.errors == (
        f"x-meshd-task-step: expected an integer 0-999999 (steps count from 0); got {value!r}",
    )


@pytest.mark.parametrize(("value", "expected"), [("1", 1), ("5", 5), ("1000000", 1_000_000)])
def test_task_steps_valid(parse: Parse, value: str, expected: int) -> None:
    r = rh(parse, [("x-meshd-task-steps", value)])
    assert (r.steps_in_task, r.errors) == (expected, ())


@pytest.mark.parametrize("value", ["0", "", "-3", "1000001", "5 steps", "0x10"])
def test_task_steps_invalid(parse: Parse, value: str) -> None:
    r = rh(parse, [("x-meshd-task-steps", value)])
    assert r.steps_in_task is None
    assert r.errors == (f"x-meshd-task-steps: expected an integer 1-1000000; got {value!r}",)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("false", False), ("TRUE", True), ("False", False), ("1", True), ("0", False)],
)
def test_task_final_valid(parse: Parse, value: str, expected: bool) -> None:
    r = rh(parse, [("x-meshd-task-final", f" {value}\t")])
    assert (r.final, r.errors) == (expected, ())


@pytest.mark.parametrize("value", ["", "yes", "no", "t", "2", "?1", "truee", "tru\u0130"])
def test_task_final_invalid(parse: Parse, value: str) -> None:
    r = rh(parse, [("x-meshd-task-final", value)])
    assert r.final is None
    assert r.errors == (f"x-meshd-task-final: expected true or false (or 1 or 0); got {value!r}",)


def test_task_step_must_be_below_the_step_count(parse: Parse) -> None:
    # A client counting from 1 sends "step 5 of 5" for its last step: caught, not misread.
    r = rh(
        parse, [("x-meshd-task-id", "t"), ("x-meshd-task-step", "5"), ("x-meshd-task-steps", "5")]
    )
    assert (r.task_id, r.step, r.steps_in_task) == ("t", None, 5)
    assert r.errors == (
        "x-meshd-task-step: 5 is not below x-meshd-task-steps 5 "
        "(steps count from 0: the last of 5 is 4)",
    )
    last = rh(parse, [("x-meshd-task-step", "4"), ("x-meshd-task-steps", "5")])
    assert (last.step, last.steps_in_task, last.errors) == (4, 5, ())


def test_task_final_may_disagree_with_the_step_count(parse: Parse) -> None:
    # An agent may finish early, or add steps: `final` is taken as sent (the ledger lets it win).
    early = rh(
        parse,
        [("x-meshd-task-step", "1"), ("x-meshd-task-steps", "5"), ("x-meshd-task-final", "true")],
    )
    assert (early.step, early.steps_in_task, early.final, early.errors) == (1, 5, True, ())
    more = rh(
        parse,
        [("x-meshd-task-step", "4"), ("x-meshd-task-steps", "5"), ("x-meshd-task-final", "0")],
    )
    assert (more.step, more.final, more.errors) == (4, False, ())


def test_task_step_headers_repeated_are_errors(parse: Parse) -> None:
    r = rh(
        parse, [("x-meshd-task-step", "1"), ("X-Meshd-Task-Step", "1"), ("x-meshd-task-steps", "3")]
    )
    assert (r.step, r.steps_in_task) == (None, 3)
    assert r.errors == ("x-meshd-task-step: repeated header; send it once (got 2 values)",)


def test_task_step_headers_stripped_when_untrusted(parse: Parse) -> None:
    headers = [
        ("x-meshd-task-step", "0"),
        ("X-Meshd-Task-Steps", "bogus"),
        ("x-meshd-task-final", "true"),
        ("host", "h"),
    ]
    r, fwd = parse(headers, False)
    assert fwd == [("host", "h")]
    assert r.stripped == ("x-meshd-task-step", "x-meshd-task-steps", "x-meshd-task-final")
    assert (r.step, r.steps_in_task, r.final, r.errors) == (None, None, None, ())


def test_long_value_is_cut_in_error(parse: Parse) -> None:
    (err,) = rh(parse, [("x-meshd-tenant", "!" * 1000)]).errors
    assert err.endswith("got " + repr("!" * 64) + "...")


def test_duplicates_are_errors(parse: Parse) -> None:
    r = rh(
        parse,
        [
            ("x-meshd-tenant", "a"),
            ("X-Meshd-Tenant", "a"),
            ("x-meshd-priority", "3"),
            ("x-meshd-priority", "4"),
            ("x-meshd-priority", "5"),
            ("x-meshd-task-id", "t"),
        ],
    )
    assert r.tenant is None
    assert r.priority is None
    assert r.task_id == "t"
    assert r.errors == (
        "x-meshd-tenant: repeated header; send it once (got 2 values)",
        "x-meshd-priority: repeated header; send it once (got 3 values)",
    )


def test_errors_in_order_of_first_appearance(parse: Parse) -> None:
    r = rh(parse, [("x-meshd-deadline-ms", "x"), ("x-meshd-priority", "x")])
    assert [e.split(":")[0] for e in r.errors] == ["x-meshd-deadline-ms", "x-meshd-priority"]


def test_unknown_meshd_header_forwarded_when_trusted(parse: Parse) -> None:
    headers = [("x-meshd-future-thing", "1"), ("X-Meshd-", "")]
    r, fwd = parse(headers, True)
    assert r == RoutingHeaders()
    assert fwd == headers


@pytest.mark.parametrize(
    "name", ["x-meshd-tenant", "X-MESHD-TENANT", "X-Meshd-Tenant", " x-meshd-tenant\t"]
)
def test_names_case_insensitive(parse: Parse, name: str) -> None:
    assert rh(parse, [(name, "acme")]).tenant == "acme"


# --- trust boundary ---------------------------------------------------------------------


def test_untrusted_strips_every_meshd_header(parse: Parse) -> None:
    headers = [
        ("Host", "h"),
        ("X-Meshd-Tenant", "acme"),
        ("x-meshd-priority", "critical"),
        ("x-meshd-priority", "garbage"),
        ("X-MESHD-Unknown", "1"),
        ("traceparent", TP),
        ("Accept", "*/*"),
    ]
    r, fwd = parse(headers, False)
    assert fwd == [("Host", "h"), ("traceparent", TP), ("Accept", "*/*")]
    assert r.stripped == (
        "x-meshd-tenant",
        "x-meshd-priority",
        "x-meshd-priority",
        "x-meshd-unknown",
    )
    # Nothing stripped is parsed: no values, no errors (not even for the duplicate).
    assert (r.tenant, r.priority, r.errors) == (None, None, ())
    # Trace Context is not ours to strip.
    assert r.trace == TraceContext(TRACE_ID, PARENT_ID, 1, None)


def test_trusted_strips_nothing(parse: Parse) -> None:
    headers = [("x-meshd-tenant", "acme"), ("x-meshd-priority", "nope")]
    r, fwd = parse(headers, True)
    assert fwd == headers
    assert r.stripped == ()
    assert r.tenant == "acme"


def test_similar_names_are_not_meshd(parse: Parse) -> None:
    headers = [("x-meshdtenant", "a"), ("meshd-tenant", "a"), ("x_meshd_tenant", "a")]
    r, fwd = parse(headers, False)
    assert fwd == headers
    assert r == RoutingHeaders()


def test_accepts_lists_and_generators(parse: Parse) -> None:
    r, fwd = parse((h for h in [["x-meshd-tenant", "a"], ("b", "c")]), True)
    assert r.tenant == "a"
    assert fwd == [("x-meshd-tenant", "a"), ("b", "c")]


def test_rejects_non_str(parse: Parse) -> None:
    with pytest.raises(TypeError):
        parse([(b"x-meshd-tenant", b"a")], True)


# --- W3C Trace Context ------------------------------------------------------------------


def tp(parse: Parse, *headers: tuple[str, str]) -> TraceContext | None:
    return rh(parse, list(headers), False).trace


def test_traceparent_valid(parse: Parse) -> None:
    assert tp(parse, ("traceparent", TP)) == TraceContext(TRACE_ID, PARENT_ID, 1, None)
    sampled_off = TP[:-2] + "00"
    assert tp(parse, ("traceparent", sampled_off)) == TraceContext(TRACE_ID, PARENT_ID, 0, None)
    assert tp(parse, ("traceparent", TP[:-2] + "ff")) == TraceContext(
        TRACE_ID, PARENT_ID, 255, None
    )


@pytest.mark.parametrize("name", ["TraceParent", "TrAcEpArEnT", "TRACEPARENT"])
def test_traceparent_name_casing(parse: Parse, name: str) -> None:
    assert tp(parse, (name, TP)) is not None


@pytest.mark.parametrize("name", ["trace-parent", "trace.parent"])
def test_traceparent_wrong_name(parse: Parse, name: str) -> None:
    assert tp(parse, (name, TP)) is None


GOOD_IDS = "12345678901234567890123456789012-1234567890123456"


@pytest.mark.parametrize(
    "value",
    [
        # from w3c/trace-context test/test.py, each case "expects a newly generated trace_id"
        f"00-{GOOD_IDS}-01.",
        f"00-{GOOD_IDS}-01-what-the-future-will-be-like",
        f"cc-{GOOD_IDS}-01.what-the-future-will-be-like",
        f"ff-{GOOD_IDS}-01",
        f".0-{GOOD_IDS}-01",
        f"0.-{GOOD_IDS}-01",
        f"000-{GOOD_IDS}-01",
        f"0000-{GOOD_IDS}-01",
        f"0-{GOOD_IDS}-01",
        "00-00000000000000000000000000000000-1234567890123456-01",
        "00-.2345678901234567890123456789012-1234567890123456-01",
        "00-1234567890123456789012345678901.-1234567890123456-01",
        "00-123456789012345678901234567890123-1234567890123456-01",
        "00-1234567890123456789012345678901-1234567890123456-01",
        "00-12345678901234567890123456789012-0000000000000000-01",
        "00-12345678901234567890123456789012-.234567890123456-01",
        "00-12345678901234567890123456789012-123456789012345.-01",
        "00-12345678901234567890123456789012-12345678901234567-01",
        "00-12345678901234567890123456789012-123456789012345-01",
        f"00-{GOOD_IDS}-.0",
        f"00-{GOOD_IDS}-0.",
        f"00-{GOOD_IDS}-001",
        f"00-{GOOD_IDS}-1",
        # uppercase hex is not HEXDIGLC
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
        f"00-{GOOD_IDS}-0A",
        "",
        "garbage",
    ],
)
def test_traceparent_invalid_is_ignored(parse: Parse, value: str) -> None:
    r = rh(parse, [("traceparent", value), ("tracestate", "foo=1")], True)
    assert r.trace is None
    assert r.errors == ()  # an invalid traceparent restarts the trace; it is not an error


@pytest.mark.parametrize(
    "value",
    [
        f"cc-{GOOD_IDS}-01",
        f"cc-{GOOD_IDS}-01-what-the-future-will-be-like",
        f"01-{GOOD_IDS}-09-",
    ],
)
def test_traceparent_future_version(parse: Parse, value: str) -> None:
    t = tp(parse, ("traceparent", value))
    assert t is not None
    assert (t.trace_id, t.parent_id) == ("12345678901234567890123456789012", "1234567890123456")


@pytest.mark.parametrize(
    "value",
    [f" {TP}", f"\t{TP}", f"{TP} ", f"{TP}\t", f"\t {TP} \t"],
)
def test_traceparent_ows(parse: Parse, value: str) -> None:
    assert tp(parse, ("traceparent", value)) == TraceContext(TRACE_ID, PARENT_ID, 1, None)


def test_traceparent_duplicated_is_ignored(parse: Parse) -> None:
    assert (
        tp(
            parse,
            ("traceparent", "00-12345678901234567890123456789011-1234567890123456-01"),
            ("traceparent", "00-12345678901234567890123456789012-1234567890123456-01"),
        )
        is None
    )


def ts(parse: Parse, *values: str) -> str | None:
    headers = [("traceparent", TP)] + [("tracestate", v) for v in values]
    t = rh(parse, headers)
    assert t.trace is not None  # failure to parse tracestate never affects traceparent
    return t.trace.tracestate


def test_tracestate_without_traceparent_is_dropped(parse: Parse) -> None:
    assert rh(parse, [("tracestate", "foo=1")]).trace is None


def test_tracestate_kept_and_combined(parse: Parse) -> None:
    assert ts(parse, "foo=1,bar=2") == "foo=1,bar=2"
    assert ts(parse, "foo=1,bar=2", "rojo=1,congo=2", "baz=3") == (
        "foo=1,bar=2,rojo=1,congo=2,baz=3"
    )
    assert ts(parse) is None


@pytest.mark.parametrize("name", ["TraceState", "TrAcEsTaTe", "TRACESTATE"])
def test_tracestate_name_casing(parse: Parse, name: str) -> None:
    r = rh(parse, [("traceparent", TP), (name, "foo=1")])
    assert r.trace is not None and r.trace.tracestate == "foo=1"


@pytest.mark.parametrize("name", ["trace-state", "trace.state"])
def test_tracestate_wrong_name(parse: Parse, name: str) -> None:
    r = rh(parse, [("traceparent", TP), (name, "foo=1")])
    assert r.trace is not None and r.trace.tracestate is None


def test_tracestate_empty_members(parse: Parse) -> None:
    assert ts(parse, "") is None
    assert ts(parse, "foo=1", "") == "foo=1"
    assert ts(parse, "", "foo=1") == "foo=1"
    assert ts(parse, " , foo=1 ,,\t,") == "foo=1"


def test_tracestate_ows(parse: Parse) -> None:
    assert ts(parse, "foo=1 \t , \t bar=2, \t baz=3") == "foo=1,bar=2,baz=3"
    assert ts(parse, "foo=1\t \t,\t \tbar=2,\t \tbaz=3") == "foo=1,bar=2,baz=3"
    for v in (" foo=1", "\tfoo=1", "foo=1 ", "foo=1\t", "\t foo=1 \t"):
        assert ts(parse, v) == "foo=1"
    # A value may start with spaces (they are part of it); it must not end with one.
    assert ts(parse, "foo=  1") == "foo=  1"


@pytest.mark.parametrize(
    "values",
    [
        ("foo=1,foo=1",),
        ("foo=1,foo=2",),
        ("foo=1", "foo=1"),
        ("foo=1", "foo=2"),
        ("foo =1",),
        ("FOO=1",),
        ("foo.bar=1",),
        ("foo@=1,bar=2",),
        ("@foo=1,bar=2",),
        ("foo@@bar=1,bar=2",),
        ("foo@bar@baz=1,bar=2",),
        ("foo=bar=baz",),
        ("foo=,bar=3",),
        ("foo",),
        ("=1",),
        ("foo=1\x7f",),
        ("foo=é",),
        ("foo=1", "z" * 257 + "=1"),
        ("foo=1", "t" * 242 + "@v=1"),
        ("foo=1", "t@" + "v" * 15 + "=1"),
        ("foo=" + "x" * 257,),
        ("1foo=1",),
        ("foo=1", "t@1v=1"),
    ],
)
def test_tracestate_invalid_is_dropped(parse: Parse, values: tuple[str, ...]) -> None:
    assert ts(parse, *values) is None


def test_tracestate_limits(parse: Parse) -> None:
    keys = [f"bar{i:02d}={i:02d}" for i in range(1, 34)]
    assert ts(parse, ",".join(keys[:32])) == ",".join(keys[:32])
    assert ts(parse, ",".join(keys[:10]), ",".join(keys[10:32])) == ",".join(keys[:32])
    assert ts(parse, ",".join(keys)) is None
    assert ts(parse, "foo=1", "z" * 256 + "=1") == "foo=1," + "z" * 256 + "=1"
    assert ts(parse, "t" * 241 + "@" + "v" * 14 + "=1") == "t" * 241 + "@" + "v" * 14 + "=1"
    assert ts(parse, "foo=" + "x" * 256) == "foo=" + "x" * 256


def test_tracestate_all_allowed_characters(parse: Parse) -> None:
    key = "abcdefghijklmnopqrstuvwxyz0123456789_-*/"
    value = "".join(map(chr, [*range(0x20, 0x2C), *range(0x2D, 0x3D), *range(0x3E, 0x7F)]))
    assert ts(parse, f"{key}={value}") == f"{key}={value}"
    vendor = key + "@a-z0-9_-*/"
    assert ts(parse, f"{vendor}={value}") == f"{vendor}={value}"
    assert ts(parse, "0tenant@vendor=x") == "0tenant@vendor=x"


# --- twin equality ----------------------------------------------------------------------

NAMES = [
    "x-meshd-tenant",
    "x-meshd-priority",
    "x-meshd-deadline-ms",
    "x-meshd-session-id",
    "x-meshd-workflow-id",
    "x-meshd-task-id",
    "x-meshd-task-step",
    "x-meshd-task-steps",
    "x-meshd-task-final",
    "x-meshd-other",
    "traceparent",
    "tracestate",
    "host",
    "x-meshd-tas\u212a-id",  # KELVIN SIGN lower-cases to "k"
    "x-meshd-tas\u212a-step",
    "x-meshd-pr\u0130ority",  # I WITH DOT lower-cases to two characters
]


def mangle_case(s: str, flips: list[bool]) -> str:
    return "".join(c.upper() if i < len(flips) and flips[i] else c for i, c in enumerate(s))


known_name = st.builds(
    lambda n, flips, pre, post: pre + mangle_case(n, flips) + post,
    st.sampled_from(NAMES),
    st.lists(st.booleans(), max_size=20),
    st.sampled_from(["", " ", "\t", " \t"]),
    st.sampled_from(["", " ", "\t", "\n"]),
)
lchex = st.text("0123456789abcdef", min_size=1, max_size=1)
trace_id = st.one_of(
    st.just(TRACE_ID),
    st.just("0" * 32),
    st.lists(lchex, min_size=32, max_size=32).map("".join),
    st.text("0123456789abcdefA.", min_size=30, max_size=34),
)
parent_id = st.one_of(
    st.just(PARENT_ID),
    st.just("0" * 16),
    st.lists(lchex, min_size=16, max_size=16).map("".join),
    st.text("0123456789abcdefA.", min_size=14, max_size=18),
)
valid_traceparent = st.builds(
    lambda v, t, p, f, tail: f"{v}-{t}-{p}-{f}{tail}",
    st.sampled_from(["00", "01", "cc"]),
    st.lists(lchex, min_size=32, max_size=32).map("".join).filter(lambda x: x != "0" * 32),
    st.lists(lchex, min_size=16, max_size=16).map("".join).filter(lambda x: x != "0" * 16),
    st.lists(lchex, min_size=2, max_size=2).map("".join),
    st.sampled_from(["", " ", "\t"]),
).filter(lambda v: v.startswith("00") or not v.endswith("\t"))
traceparent_like = st.one_of(
    valid_traceparent,
    st.builds(
        lambda v, t, p, f, tail: f"{v}-{t}-{p}-{f}{tail}",
        st.sampled_from(["00", "00", "01", "cc", "ff", "0g", "0", "AA"]),
        trace_id,
        parent_id,
        st.sampled_from(["01", "00", "ff", "0A", "1", "001", ".0"]),
        st.sampled_from(["", "", "-", "-x", ".x", " ", "\t"]),
    ),
)
good_member = st.builds(
    lambda k, v, pad: pad + k + "=" + v + pad,
    st.one_of(
        st.text("abcdefghijklmnopqrstuvwxyz", min_size=2, max_size=8),
        st.builds(
            lambda t, v: t + "@" + v, st.text("a1b2", min_size=1), st.text("xyz", min_size=1)
        ),
    ),
    st.text("abc 1~!", min_size=0, max_size=6).map(lambda v: v + "x"),
    st.sampled_from(["", " ", "\t"]),
)
ts_member = st.one_of(
    good_member,
    st.sampled_from(["", " ", "FOO=1", "foo", "a=b=c", "a= "]),
    st.builds(
        lambda k, v: f"{k}={v}",
        st.text("abz019_-*/@A. ", min_size=0, max_size=12),
        st.text("abc =,1\t~\x7f", min_size=0, max_size=8),
    ),
)
tracestate_like = st.one_of(
    st.lists(good_member, max_size=4),
    st.lists(ts_member, max_size=36),
).map(",".join)
VALUES = {
    "x-meshd-priority": st.one_of(
        st.sampled_from(["critical", "HIGH", "Low", "standard", "sheddable", "7", " 0 "]),
        st.text("0123456789 \t", max_size=3),
    ),
    "x-meshd-deadline-ms": st.one_of(
        st.integers(min_value=-5, max_value=90_000_000).map(str),
        st.text("0123456789 \t", max_size=12),
    ),
    "x-meshd-task-step": st.one_of(
        st.integers(min_value=-2, max_value=1_000_002).map(str),
        st.text("0123456789 \t+-", max_size=10),
    ),
    "x-meshd-task-steps": st.one_of(
        st.integers(min_value=-2, max_value=1_000_002).map(str),
        st.text("0123456789 \t", max_size=10),
    ),
    "x-meshd-task-final": st.one_of(
        st.sampled_from(["true", "false", "TRUE", "False", "1", "0", " true ", "yes", ""]),
        st.text("truefalsTRUEFALS01\u0130\u212a ", max_size=7),
    ),
}
MESHD_NAMES = [n for n in NAMES if n.startswith("x-meshd-") and n.isascii()]
id_value = st.one_of(st.text("abcXYZ019._:/@+=- \t", max_size=140), st.text(max_size=10))
meshd_header = st.sampled_from(MESHD_NAMES).flatmap(
    lambda n: st.tuples(
        st.builds(mangle_case, st.just(n), st.lists(st.booleans(), max_size=20)),
        VALUES.get(n, id_value),
    )
)
any_value = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["critical", "HIGH", "low", "7", "10", "0", "00042", "86400001", ""]),
    st.text("0123456789 \t", max_size=12),
    st.text("abcXYZ019._:/@+=- ", max_size=140),
    traceparent_like,
    tracestate_like,
)
header = st.one_of(
    st.tuples(st.one_of(known_name, st.text(max_size=25)), any_value),
    meshd_header,
    st.tuples(st.sampled_from(["traceparent", "TraceParent"]), traceparent_like),
    st.tuples(st.just("traceparent"), valid_traceparent),
    st.tuples(st.sampled_from(["tracestate", " TRACESTATE"]), tracestate_like),
)


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(headers=st.lists(header, max_size=14), trusted=st.booleans())
def test_twins_equal(headers: Headers, trusted: bool) -> None:
    assert compiled is not None
    expected = pure.parse_routing_headers(headers, trusted)
    got = compiled.parse_routing_headers(headers, trusted)
    assert got == expected
    assert repr(got[0]) == repr(expected[0])


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(tp_value=traceparent_like, states=st.lists(tracestate_like, max_size=3))
def test_twins_equal_trace_context(tp_value: str, states: list[str]) -> None:
    assert compiled is not None
    headers = [("traceparent", tp_value)] + [("tracestate", s) for s in states]
    assert compiled.parse_routing_headers(headers, True) == pure.parse_routing_headers(
        headers, True
    )


TASK_STEP_NAMES = ["x-meshd-task-step", "x-meshd-task-steps", "x-meshd-task-final"]
task_step_header = st.sampled_from(TASK_STEP_NAMES).flatmap(
    lambda n: st.tuples(
        st.builds(mangle_case, st.just(n), st.lists(st.booleans(), max_size=20)),
        st.one_of(VALUES[n], st.text(max_size=12)),
    )
)


@needs_compiled
@settings(max_examples=200, deadline=None)
@given(headers=st.lists(task_step_header, max_size=5), trusted=st.booleans())
def test_twins_equal_task_steps(headers: Headers, trusted: bool) -> None:
    assert compiled is not None
    expected = pure.parse_routing_headers(headers, trusted)
    assert compiled.parse_routing_headers(headers, trusted) == expected


@settings(max_examples=200, deadline=None)
@given(headers=st.lists(task_step_header, max_size=5))
def test_task_step_values_are_parsed_or_named_in_an_error(headers: Headers) -> None:
    """Fuzz: each task-step header either gives its field or an error naming it; never both,
    never silence, never anything but these three headers' fields."""
    for impl in (pure, compiled) if compiled is not None else (pure,):
        r, fwd = impl.parse_routing_headers(headers, True)
        assert fwd == [tuple(h) for h in headers]
        assert (r.tenant, r.priority, r.task_id, r.trace) == (None, None, None, None)
        named = {e.split(":", 1)[0] for e in r.errors}
        assert named <= set(TASK_STEP_NAMES)
        for name, field in zip(TASK_STEP_NAMES, ("step", "steps_in_task", "final"), strict=True):
            sent = [h for h in headers if h[0].lower() == name]
            value = getattr(r, field)
            if not sent:
                assert value is None and name not in named
            elif name == "x-meshd-task-step" and value is None and name in named:
                pass  # bad, repeated, or not below the step count
            else:
                assert (value is None) == (name in named)
        if r.step is not None and r.steps_in_task is not None:
            assert 0 <= r.step < r.steps_in_task <= pure.TASK_STEPS_MAX


@needs_compiled
def test_compiled_builds_real_dataclasses() -> None:
    assert compiled is not None
    r, _ = compiled.parse_routing_headers([("traceparent", TP), ("x-meshd-tenant", "a")], True)
    assert type(r) is RoutingHeaders and type(r.trace) is TraceContext
    assert r == RoutingHeaders(tenant="a", trace=TraceContext(TRACE_ID, PARENT_ID, 1, None))
    assert hash(r) == hash(
        RoutingHeaders(tenant="a", trace=TraceContext(TRACE_ID, PARENT_ID, 1, None))
    )
    with pytest.raises(AttributeError):
        r.tenant = "b"  # type: ignore[misc]
