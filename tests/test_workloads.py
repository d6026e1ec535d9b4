"""Tests for loadtest.workloads: trace parsing, hit-rate bounds, determinism, text sharing.

The real traces come from the shared traces directory (README there gives the figures
reproduced here); tests that need them skip when it is absent.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.workloads import (
    AZURE_CODE,
    AZURE_CONV,
    MOONCAKE_SYNTHETIC,
    TRACES_ENV,
    VOCABULARY,
    WORKLOADS,
    Burst,
    Kind,
    Message,
    PlannedRequest,
    Tenant,
    TraceFormatError,
    agentic,
    assign_tenants,
    block_text,
    block_words,
    bursty,
    count_tokens,
    demo,
    describe,
    extend,
    mix,
    multi_turn,
    parse_azure,
    parse_mooncake,
    parse_tenants,
    poisson,
    quantile,
    read_azure,
    read_mooncake,
    render,
    round_robin_bound,
    shared_prefix,
    synthetic_block_id,
    traces_dir,
    upper_bound_hit_rate,
)

TRACES = traces_dir()
needs_traces = pytest.mark.skipif(
    not (TRACES / MOONCAKE_SYNTHETIC).exists(), reason=f"no traces in {TRACES}"
)


def _mooncake_line(ts: float, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}
    )


def _write(path: Path, lines: list[str], trailing_newline: bool = True) -> Path:
    path.write_text("\n".join(lines) + ("\n" if trailing_newline else ""), encoding="utf-8")
    return path


# --- text -------------------------------------------------------------------------------


def test_vocabulary_is_4096_distinct_single_token_words() -> None:
    assert len(VOCABULARY) == 4096
    assert len(set(VOCABULARY)) == 4096
    assert all(w.isascii() and w.isalpha() and w.islower() for w in VOCABULARY)
    assert all(count_tokens(w) == 1 for w in VOCABULARY)


def test_block_words_are_a_pure_function_of_block_index_and_seed() -> None:
    long = block_words(7, 100)
    assert block_words(7, 100) == long
    assert block_words(7, 33) == long[:33]  # token i does not depend on the block length
    assert block_words(8, 100) != long
    assert block_words(7, 100, seed=1) != long
    assert count_tokens(block_text(7, 517)) == 517
    assert block_text(7, 0) == ""


def test_block_ids_must_fit_63_bits() -> None:
    with pytest.raises(ValueError, match="block id"):
        block_words(-1, 3)
    with pytest.raises(ValueError, match="block id"):
        block_words(1 << 63, 3)
    assert 0 <= synthetic_block_id("x", 1, 2) < 1 << 63
    assert synthetic_block_id("x", 1, 2) != synthetic_block_id("x", 12)


def test_extend_adds_token_counts() -> None:
    assert extend("a b", "  c d e \n", "f") == "a b c d e f"
    assert extend("a b", "", "f") == "a b f"


@settings(max_examples=50)
@given(st.text(max_size=40), st.text(max_size=40), st.text(max_size=40))
def test_extend_token_count_is_the_sum(p: str, a: str, n: str) -> None:
    assert count_tokens(extend(p, a, n)) == count_tokens(p) + count_tokens(a) + count_tokens(n)


# --- Mooncake ----------------------------------------------------------------------------


def test_mooncake_parse_fields_and_shared_prefix_text(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        [
            _mooncake_line(1000, 1200, 10, [0, 1, 2]),
            _mooncake_line(1500, 1100, 0, [0, 1, 3]),
            _mooncake_line(2500, 300, 5, [0]),
        ],
    )
    a, b, c = read_mooncake(path)
    assert [r.at_s for r in (a, b, c)] == [0.0, 0.5, 1.5]
    assert [r.prompt_tokens for r in (a, b, c)] == [1200, 1100, 300]
    assert [r.max_tokens for r in (a, b, c)] == [10, 1, 5]  # output 0 -> at least 1
    assert [r.block_ids for r in (a, b, c)] == [(0, 1, 2), (0, 1, 3), (0,)]
    assert [r.request_id for r in (a, b, c)] == ["t:1", "t:2", "t:3"]
    assert all(count_tokens(r.own_text) == r.prompt_tokens for r in (a, b, c))
    wa, wb, wc = (r.own_text.split() for r in (a, b, c))
    assert wa[:1024] == wb[:1024]  # equal hash ids -> identical text
    assert wa[1024:1100] != wb[1024:1100]
    assert wc == wa[:300]  # a partial block is a prefix of the full block
    assert a.prompt is not None and b.prompt is not None
    assert a.prompt.startswith(" ".join(wa[:1024]) + " ")


def test_mooncake_token_scale_shrinks_blocks_and_keeps_sharing(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        [_mooncake_line(0, 1200, 100, [0, 1, 2]), _mooncake_line(10, 1100, 7, [0, 1, 3])],
    )
    a, b = read_mooncake(path, token_scale=0.05)
    # block 512 -> 26 tokens; last blocks 176 -> 9 and 76 -> 4.
    assert (a.prompt_tokens, b.prompt_tokens) == (26 * 2 + 9, 26 * 2 + 4)
    assert (a.max_tokens, b.max_tokens) == (5, 1)
    assert a.own_text.split()[:52] == b.own_text.split()[:52]
    assert count_tokens(a.own_text) == a.prompt_tokens
    assert upper_bound_hit_rate([a, b]) == pytest.approx(2 / 6)


def test_mooncake_cap_and_time_scale(tmp_path: Path) -> None:
    lines = [_mooncake_line(1000 * i, 10, 1, [i]) for i in range(10)]
    path = _write(tmp_path / "t.jsonl", lines)
    assert len(read_mooncake(path, cap=3)) == 3
    assert read_mooncake(path, cap=0) == []
    assert [r.at_s for r in read_mooncake(path, cap=3, time_scale=2.0)] == [0.0, 0.5, 1.0]
    assert [r.at_s for r in read_mooncake(path, cap=3, time_scale=0.5)] == [0.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="time_scale"):
        read_mooncake(path, time_scale=0)
    with pytest.raises(ValueError, match="cap"):
        read_mooncake(path, cap=-1)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "Expecting"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing field 'hash_ids'"),
        (_mooncake_line(0, 1200, 1, [1, 2]), "expected ceil"),
        (_mooncake_line(-5, 10, 1, [1]), "timestamp"),
        (_mooncake_line(0, 0, 1, []), "input_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [true]}', "hash"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_mooncake_malformed_row_names_file_and_line(tmp_path: Path, bad: str, reason: str) -> None:
    path = _write(tmp_path / "t.jsonl", [_mooncake_line(0, 10, 1, [0]), "", bad])
    with pytest.raises(TraceFormatError, match=reason) as info:
        read_mooncake(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert info.value.line == 3
    errors: list[str] = []
    kept = read_mooncake(path, strict=False, errors=errors)
    assert [r.request_id for r in kept] == ["t:1"]
    assert len(errors) == 1 and errors[0].startswith(f"{path}:3: ")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(max_size=60), max_size=5))
def test_mooncake_parser_accepts_or_raises_the_format_error(lines: list[str]) -> None:
    try:
        parse_mooncake(lines)
    except TraceFormatError as exc:
        assert exc.line >= 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 10**7), st.integers(1, 3000), st.integers(0, 500), st.integers(0, 50)
        ),
        max_size=8,
    )
)
def test_mooncake_round_trip(rows: list[tuple[int, int, int, int]]) -> None:
    lines = [
        _mooncake_line(ts, n_in, n_out, [base + k for k in range(-(-n_in // 512))])
        for ts, n_in, n_out, base in rows
    ]
    requests = parse_mooncake(lines, time_scale=4.0, token_scale=0.02)
    assert len(requests) == len(rows)
    assert [r.at_s for r in requests] == sorted(r.at_s for r in requests)
    origin = min((ts for ts, *_ in rows), default=0)
    assert sorted(r.at_s for r in requests) == sorted((ts - origin) / 4000 for ts, *_ in rows)
    assert all(count_tokens(r.own_text) == r.prompt_tokens for r in requests)


@needs_traces
def test_synthetic_trace_reproduces_readme_figures() -> None:
    requests = read_mooncake(TRACES / MOONCAKE_SYNTHETIC, token_scale=0.01)
    assert len(requests) == 3993
    assert requests[-1].at_s == pytest.approx(1022.025)
    # README gives 3 digits: the true value is within half a unit of the last one.
    assert abs(upper_bound_hit_rate(requests) - 0.640) <= 0.0005
    for n, bound in [(4, 0.365), (8, 0.226), (16, 0.136)]:
        assert abs(round_robin_bound(requests, n) - bound) <= 0.0005
    # README: 3.91 req/s.
    assert len(requests) / requests[-1].at_s == pytest.approx(3.91, abs=0.005)


@needs_traces
def test_synthetic_trace_capped_replay_is_cheap_and_consistent() -> None:
    requests = read_mooncake(TRACES / MOONCAKE_SYNTHETIC, cap=50, time_scale=10.0)
    assert len(requests) == 50
    assert [r.request_id for r in requests[:2]] == ["synthetic_trace:1", "synthetic_trace:2"]
    assert requests[0].prompt_tokens == 40160 and requests[0].max_tokens == 6
    assert requests[2].at_s == pytest.approx(0.004)  # 40 ms at 10x
    assert all(count_tokens(r.own_text) == r.prompt_tokens for r in requests)


# --- Azure ------------------------------------------------------------------------------


AZURE_ROWS = [
    "TIMESTAMP,ContextTokens,GeneratedTokens",
    "2023-11-16 18:17:03.9799600,4808,10",
    "2023-11-16 18:17:04.0319600,3180,8",
    "2023-11-16 18:17:05.9799601,20,0",
]


def test_azure_parse_offsets_tokens_and_missing_final_newline(tmp_path: Path) -> None:
    path = _write(tmp_path / "az.csv", AZURE_ROWS, trailing_newline=False)
    a, b, c = read_azure(path)
    assert [r.at_s for r in (a, b, c)] == [0.0, pytest.approx(0.052, abs=1e-12), 2.0000001]
    assert [(r.prompt_tokens, r.max_tokens) for r in (a, b, c)] == [(4808, 10), (3180, 8), (20, 1)]
    assert all(count_tokens(r.own_text) == r.prompt_tokens for r in (a, b, c))
    assert a.request_id == "az:2" and a.workload == "az"
    # No prefix information: nothing is shared.
    assert upper_bound_hit_rate([a, b, c]) == 0.0
    assert a.own_text.split()[:20] != c.own_text.split()
    scaled = read_azure(path, time_scale=2.0, token_scale=0.1)
    assert [(r.prompt_tokens, r.max_tokens) for r in scaled] == [(481, 1), (318, 1), (2, 1)]
    assert scaled[2].at_s == pytest.approx(1.00000005)
    assert len(read_azure(path, cap=2)) == 2


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("2023-11-16 18:17:04.0319600,3180", "3 comma-separated"),
        ("yesterday,3180,8", "TIMESTAMP"),
        ("2023-13-16 18:17:04.03,3180,8", "TIMESTAMP"),
        ("2023-11-16 18:17:04.03,many,8", "ContextTokens"),
        ("2023-11-16 18:17:04.03,0,8", "ContextTokens must be >= 1"),
        ("2023-11-16 18:17:04.03,10,-1", "GeneratedTokens"),
    ],
)
def test_azure_malformed_row_names_file_and_line(tmp_path: Path, bad: str, reason: str) -> None:
    path = _write(tmp_path / "az.csv", [*AZURE_ROWS[:2], bad, AZURE_ROWS[3]])
    with pytest.raises(TraceFormatError, match=reason) as info:
        read_azure(path)
    assert str(info.value).startswith(f"{path}:3: ")
    errors: list[str] = []
    assert len(read_azure(path, strict=False, errors=errors)) == 2
    assert errors == [str(info.value)]


def test_azure_header_is_required(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r":1: expected header"):
        read_azure(_write(tmp_path / "a.csv", AZURE_ROWS[1:]), strict=False)
    with pytest.raises(TraceFormatError, match="missing header"):
        read_azure(_write(tmp_path / "b.csv", []))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(max_size=50), max_size=4))
def test_azure_parser_accepts_or_raises_the_format_error(rows: list[str]) -> None:
    try:
        parse_azure([AZURE_ROWS[0], *rows])
    except TraceFormatError as exc:
        assert exc.line >= 2


@needs_traces
@pytest.mark.parametrize(
    ("name", "rows", "duration_s"),
    [(AZURE_CODE, 8819, 3435.948056), (AZURE_CONV, 19366, 3501.721937)],
)
def test_azure_traces_reproduce_readme_figures(name: str, rows: int, duration_s: float) -> None:
    requests = read_azure(TRACES / name, token_scale=0.01)
    assert len(requests) == rows
    assert requests[-1].at_s == pytest.approx(duration_s, abs=1e-9)
    if name == AZURE_CODE:
        # README: "very bursty (up to 67 requests in one second)".
        assert max(Counter(math.floor(r.at_s) for r in requests).values()) == 67


# --- generators --------------------------------------------------------------------------


def _chains_ok(requests: list[PlannedRequest]) -> None:
    """Sorted, ids unique, prompt_tokens consistent, chains in order and extending context."""
    assert [r.at_s for r in requests] == sorted(r.at_s for r in requests)
    assert len({r.request_id for r in requests}) == len(requests)
    last: dict[str, PlannedRequest] = {}
    for r in requests:
        assert count_tokens(r.own_text) == r.prompt_tokens
        chain = r.chain_id
        if chain is None:
            assert not r.depends_on_previous
            continue
        previous = last.get(chain)
        if previous is None:
            assert r.step == 0 and not r.depends_on_previous
        else:
            assert r.step == (previous.step or 0) + 1 and r.depends_on_previous
            assert r.block_ids[: len(previous.block_ids)] == previous.block_ids
            assert r.at_s == pytest.approx(previous.at_s + r.think_s)
            assert r.tenant == previous.tenant
        last[chain] = r
    for r in last.values():
        assert r.step is not None and r.steps_in_task == r.step + 1  # every chain is complete


GENERATORS = {
    "shared-prefix": lambda seed: shared_prefix(3, 4, 40, 8, 16, 5.0, seed, block_tokens=8),
    "shared-prefix-chat-bursty": lambda seed: shared_prefix(
        2, 5, 20, 4, 8, 5.0, seed, kind="chat", burst=Burst(2.0, 1.0, 1.0)
    ),
    "multi-turn": lambda seed: multi_turn(4, (1, 4), 24, 6, 16, 1.0, 2.0, seed),
    "multi-turn-completion": lambda seed: multi_turn(
        3, 3, 0, 6, 16, 1.0, 2.0, seed, kind="completion", shared_system_prompt=False
    ),
    "agentic": lambda seed: agentic(4, (2, 5), 12, 10_000, 30, 16, 0.2, 1.0, seed),
    "agentic-chat": lambda seed: agentic(3, 3, 12, 10_000, 30, 16, 0.0, 1.0, seed, kind="chat"),
    "demo": lambda seed: demo(seed=seed, load=0.2, duration_s=20.0),
}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_deterministic_and_well_formed(name: str) -> None:
    make = GENERATORS[name]
    first = make(3)
    assert first, "a generator with these arguments makes requests"
    assert make(3) == first
    assert make(4) != first
    assert [r.own_text for r in make(4)] != [r.own_text for r in first]
    _chains_ok(first)


def test_shared_prefix_groups_share_their_system_text_only() -> None:
    requests = shared_prefix(4, 6, 50, 10, 16, 5.0, 0, block_tokens=16)
    by_group: dict[str, list[list[str]]] = {}
    for r in requests:
        by_group.setdefault(r.request_id.split("-g")[1].split("-")[0], []).append(
            r.own_text.split()
        )
    assert len(by_group) == 4 and all(len(v) == 6 for v in by_group.values())
    heads = {tuple(words[:50]) for words in next(iter(by_group.values()))}
    assert len(heads) == 1  # identical system prompt within a group
    assert len({tuple(v[0][:50]) for v in by_group.values()}) == 4  # distinct across groups
    assert len({tuple(words[50:]) for v in by_group.values() for words in v}) == 24
    # 4 system blocks per request, repeated by all but the first of each group.
    assert upper_bound_hit_rate(requests) == pytest.approx(4 * 5 * 4 / (24 * 5))
    order = [r.request_id.split("-g")[1][0] for r in requests]
    assert order != sorted(order)  # groups interleave


def test_multi_turn_chat_contract_render() -> None:
    requests = multi_turn(1, 3, 8, 4, 16, 1.0, 1.0, 0)
    t0, t1, t2 = requests
    assert t0.messages is not None and [m.role for m in t0.messages] == ["system", "user"]
    assert t1.messages is not None and len(t1.messages) == 1 and t1.prompt is None
    assert t0.session_id == t1.session_id and t0.task_id is None
    sent0 = render(t0)
    with pytest.raises(ValueError, match="depends on step 0"):
        render(t1)
    with pytest.raises(TypeError):
        render(t1, "a prompt", "x")
    sent1 = render(t1, sent0, "hello there")
    assert sent1 == (*t0.messages, Message("assistant", "hello there"), *t1.messages)
    sent2 = render(t2, sent1, "bye")
    assert isinstance(sent2, tuple) and len(sent2) == 6


def test_agentic_steps_extend_previous_prompt_and_answer() -> None:
    requests = agentic(2, 3, 10, 5_000, 20, 8, 0.5, 1.0, 7, step_deadline_ms=900)
    task = [r for r in requests if r.task_id == requests[0].task_id]
    assert [r.step for r in task] == [0, 1, 2]
    assert all(r.task_deadline_ms == 5_000 and r.deadline_ms == 900 for r in task)
    assert all(r.session_id is None and r.steps_in_task == 3 for r in task)
    sent = render(task[0])
    assert isinstance(sent, str) and count_tokens(sent) == 30
    for step in task[1:]:
        new = render(step, sent, "did a thing")
        assert isinstance(new, str) and new.startswith(sent + " did a thing ")
        assert count_tokens(new) == count_tokens(sent) + 3 + step.prompt_tokens
        sent = new
    # Both tasks start with the same tool prompt.
    other = next(r for r in requests if r.task_id != task[0].task_id and r.step == 0)
    assert other.own_text.split()[:20] == task[0].own_text.split()[:20]


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["completion", "chat"]),
    generator=st.sampled_from(["shared-prefix", "multi-turn", "agentic"]),
    count=st.integers(0, 5),
    steps=st.integers(1, 4),
    system=st.integers(0, 40),
    tokens=st.integers(1, 30),
    block=st.integers(1, 20),
    think=st.sampled_from([0.0, 0.5]),
    bursty_=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_generated_requests_are_sorted_with_consistent_prompt_tokens(
    kind: str,
    generator: str,
    count: int,
    steps: int,
    system: int,
    tokens: int,
    block: int,
    think: float,
    bursty_: bool,
    seed: int,
) -> None:
    burst = Burst(2.0, 1.0, 2.0) if bursty_ else None
    k: Kind = "chat" if kind == "chat" else "completion"
    if generator == "shared-prefix":
        requests = shared_prefix(
            count, steps, system, tokens, 8, 3.0, seed, kind=k, burst=burst, block_tokens=block
        )
        assert len(requests) == count * steps
    elif generator == "multi-turn":
        requests = multi_turn(
            count,
            (1, steps),
            system,
            tokens,
            8,
            think,
            2.0,
            seed,
            kind=k,
            burst=burst,
            block_tokens=block,
        )
    else:
        requests = agentic(
            count,
            steps,
            tokens,
            1000,
            system,
            8,
            think,
            2.0,
            seed,
            kind=k,
            burst=burst,
            block_tokens=block,
        )
        assert len(requests) == count * steps
    _chains_ok(requests)
    assert all(r.kind == k for r in requests)


def test_mix_merges_by_time_and_rejects_duplicate_ids() -> None:
    a = shared_prefix(2, 3, 8, 4, 8, 2.0, 0)
    b = agentic(2, 2, 4, 1000, 8, 8, 0.1, 2.0, 0)
    merged = mix(a, b)
    assert len(merged) == len(a) + len(b)
    _chains_ok(merged)
    assert mix(a, b) == merged
    with pytest.raises(ValueError, match="more than one workload"):
        mix(a, a)


# --- arrivals and tenants ----------------------------------------------------------------


def test_poisson_rate_and_gaps() -> None:
    times = poisson(5.0, 20_000, random.Random(1))
    assert times == sorted(times) and times[0] > 0
    assert 20_000 / times[-1] == pytest.approx(5.0, rel=0.03)
    with pytest.raises(ValueError, match="rate"):
        poisson(0.0, 3, random.Random(1))


def _dispersion(times: list[float]) -> float:
    counts = Counter(math.floor(t) for t in times)
    per_second = [counts.get(s, 0) for s in range(math.floor(times[-1]))]
    return statistics.variance(per_second) / statistics.mean(per_second)


def test_bursty_keeps_the_mean_rate_and_is_overdispersed() -> None:
    times = bursty(5.0, 20_000, random.Random(1), burst_factor=3.0, on_s=2.0, off_s=6.0)
    assert times == sorted(times)
    assert 20_000 / times[-1] == pytest.approx(5.0, rel=0.1)
    assert _dispersion(times) > 3.0  # a Poisson process has index of dispersion ~1
    assert _dispersion(poisson(5.0, 20_000, random.Random(1))) < 1.3
    # At the limit 1 + off/on the OFF state is silent; beyond it, no valid rate exists.
    assert len(bursty(5.0, 100, random.Random(1), burst_factor=4.0)) == 100
    with pytest.raises(ValueError, match="burst_factor"):
        bursty(5.0, 100, random.Random(1), burst_factor=4.01)


def test_tenants_parse_assign_and_weights() -> None:
    mix_ = parse_tenants("gold:1:9, silver:2 ,free")
    assert mix_ == (Tenant("gold", 1.0, 9), Tenant("silver", 2.0, 5), Tenant("free", 1.0, 5))
    for bad in ("", "a:b", "a:1:10", "a,a", "a b", "a:1:2:3", "a:0"):
        with pytest.raises(ValueError):
            parse_tenants(bad)
    requests = assign_tenants(
        mix(shared_prefix(10, 60, 4, 4, 8, 5.0, 0), multi_turn(20, 3, 4, 4, 8, 1.0, 2.0, 0)),
        (Tenant("a", 3.0, 9), Tenant("b", 1.0, 1)),
        seed=5,
    )
    counts = Counter(r.tenant for r in requests if r.chain_id is None)
    assert counts["a"] / sum(counts.values()) == pytest.approx(0.75, abs=0.06)
    assert all(r.priority == (9 if r.tenant == "a" else 1) for r in requests)
    per_session: dict[str, set[str]] = {}
    for r in requests:
        if r.chain_id:
            per_session.setdefault(r.chain_id, set()).add(r.tenant)
    assert all(len(t) == 1 for t in per_session.values())


# --- summaries, registry, paths ----------------------------------------------------------


def test_quantile_is_linear_interpolation() -> None:
    assert quantile([1, 2, 3, 4], 0.5) == 2.5
    assert quantile([5], 0.99) == 5
    assert quantile([], 0.5) == 0.0


def test_describe_summarises_a_workload() -> None:
    requests = mix(shared_prefix(2, 2, 16, 4, 8, 2.0, 0), agentic(1, 3, 4, 1000, 8, 10, 0, 2.0, 0))
    summary = describe(requests, replicas=(2,))
    assert summary["requests"] == 7
    assert summary["chains"] == 1 and summary["dependent_requests"] == 2
    assert summary["duration_s"] == requests[-1].at_s
    assert summary["prompt_tokens"] == {"mean": 100 / 7, "p50": 20.0, "p99": 20.0, "max": 20}
    # Agentic: 12, 12 + 10 + 4, 26 + 10 + 4.
    ctx = summary["context_tokens_est"]
    assert isinstance(ctx, dict) and ctx["max"] == 40
    assert summary["upper_bound_hit_rate"] == upper_bound_hit_rate(requests)
    assert summary["round_robin_bound"] == {"2": round_robin_bound(requests, 2)}
    json.dumps(summary)


def test_registry_names_and_defaults() -> None:
    assert set(WORKLOADS) >= {
        "shared-prefix",
        "multi-turn",
        "agentic",
        "mooncake",
        "azure-code",
        "azure-conv",
        "demo",
    }
    for name in ("shared-prefix", "multi-turn", "agentic"):
        requests = WORKLOADS[name](seed=1)
        assert requests == WORKLOADS[name](seed=1)
        _chains_ok(requests)


def test_demo_is_about_a_minute_of_modest_load() -> None:
    requests = demo()
    summary = describe(requests)
    assert 55 <= requests[-1].at_s <= 90
    rate = summary["rate_rps"]
    assert isinstance(rate, float) and 3.0 <= rate <= 8.0
    tenants = summary["tenants"]
    assert isinstance(tenants, dict) and set(tenants) == {"gold", "silver", "bronze"}
    _chains_ok(requests)


@needs_traces
def test_registry_trace_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("mooncake", "azure-code", "azure-conv"):
        requests = WORKLOADS[name](cap=5, time_scale=2.0)
        assert len(requests) == 5 and requests[0].at_s == 0.0
    assert WORKLOADS["mooncake"](cap=1)[0].prompt_tokens == 26 * 78 + round(224 * 0.05)
    # The directory is a parameter, with an environment override of the default.
    _write(tmp_path / MOONCAKE_SYNTHETIC, [_mooncake_line(0, 10, 1, [0])])
    assert len(WORKLOADS["mooncake"](traces_dir=tmp_path)) == 1
    monkeypatch.setenv(TRACES_ENV, str(tmp_path))
    assert traces_dir() == tmp_path
    assert len(WORKLOADS["mooncake"]()) == 1
    assert traces_dir("/elsewhere") == Path("/elsewhere")


def test_default_traces_dir_is_beside_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACES_ENV, raising=False)
    repo = Path(__file__).resolve().parents[1]
    assert traces_dir() == repo.parent / "shared" / "data" / "traces"


def test_planned_request_rejects_inconsistent_values() -> None:
    ok = dict(
        request_id="r",
        workload="w",
        at_s=0.0,
        kind="completion",
        prompt="a",
        messages=None,
        max_tokens=1,
        prompt_tokens=1,
    )
    PlannedRequest(**ok)  # type: ignore[arg-type]
    for change in (
        {"at_s": -1.0},
        {"at_s": math.nan},
        {"kind": "chat"},
        {"messages": (Message("user", "a"),)},
        {"max_tokens": 0},
        {"priority": 10},
        {"step": 0},
        {"step": 2, "steps_in_task": 2},
        {"depends_on_previous": True},
        {"depends_on_previous": True, "task_id": "t", "step": 0, "steps_in_task": 2},
        {"deadline_ms": 0},
        {"think_s": -0.1},
    ):
        with pytest.raises(ValueError):
            PlannedRequest(**{**ok, **change})  # type: ignore[arg-type]
