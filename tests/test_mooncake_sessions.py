"""Mooncake's conversations as closed-loop sessions (traces.mooncake_sessions), the client
that withholds session headers, and the robustness matrix's arithmetic and one real cell."""

from __future__ import annotations

import json

import pytest

from loadtest.bench import matrix as M
from loadtest.bench.client import ClientSettings, RequestOutcome, request_headers
from loadtest.workloads.registry import WORKLOADS
from loadtest.workloads.request import render
from loadtest.workloads.traces import first_sessions, mooncake_sessions, parse_mooncake

BLOCK = 4  # tokens per block in these tests


def rows(*specs: tuple[float, int, list[int]]) -> list[str]:
    return [
        json.dumps({"timestamp": ts, "input_length": n, "output_length": 3, "hash_ids": ids})
        for ts, n, ids in specs
    ]


def plan(lines: list[str], **kw):
    reqs = parse_mooncake(lines, "t.jsonl", block_tokens=BLOCK)
    return reqs, mooncake_sessions(reqs, block_tokens=BLOCK, **kw)


def test_turns_that_extend_a_prompt_become_one_session():
    reqs, out = plan(
        rows(
            (0, 6, [1, 2]),  # a: blocks 1, 2 (the last partial)
            (100, 11, [1, 2, 3]),  # continues a (a's full blocks: [1])
            (200, 5, [7, 8]),  # unrelated
            (300, 15, [1, 2, 3, 4]),  # continues the second turn
        )
    )
    by = {r.request_id: r for r in out}
    first, second, other, third = (by[f"t:{i}"] for i in (1, 2, 3, 4))
    assert first.session_id == second.session_id == third.session_id != other.session_id
    assert [first.step, second.step, third.step] == [0, 1, 2]
    assert first.steps_in_task == 3 and other.steps_in_task == 1
    assert not first.depends_on_previous and second.depends_on_previous
    assert second.think_s == 2.0 and second.at_s == first.at_s + 2.0
    # A turn carries only what follows its parent's blocks; the runner prepends the
    # parent's prompt and answer, so the engine sees the history, then the new turn.
    original = {r.request_id: r for r in reqs}
    words = original["t:2"].prompt.split(" ")
    assert second.prompt == " ".join(words[2 * BLOCK :])
    sent = render(second, first.prompt, "the answer")
    assert sent.startswith(first.prompt + " the answer ") and sent.endswith(second.prompt)
    assert second.prompt_tokens == len(second.prompt.split(" "))
    # Its blocks for the hit-rate bound: the parent's, then its own new ones.
    assert second.block_ids == first.block_ids + original["t:2"].block_ids[2:]


def test_a_long_chain_is_split_at_max_steps_and_a_parent_is_continued_once():
    lines = rows(
        (0, 4, [1]),
        *[(10 * k, 4 * (k + 1), list(range(1, k + 2))) for k in range(1, 6)],
        (100, 8, [1, 2]),  # a second continuation of an already continued prompt
    )
    _, out = plan(lines, max_steps=3)
    chains: dict[str, list[int]] = {}
    for r in out:
        chains.setdefault(r.session_id or "", []).append(r.step or 0)
    assert all(len(steps) <= 3 for steps in chains.values())
    # t:1 (one partial block) continues nothing; t:2 -> t:3 -> t:4 reach the cap, so t:5
    # starts again (-> t:6); t:7 would continue t:2, which t:3 already continued.
    assert sorted(len(s) for s in chains.values()) == [1, 1, 2, 3]
    by = {r.request_id: r for r in out}
    assert by["t:5"].step == 0 and by["t:6"].session_id == by["t:5"].session_id
    assert by["t:7"].step == 0 and by["t:7"].steps_in_task == 1
    with pytest.raises(ValueError):
        mooncake_sessions([], max_steps=0)


def test_the_workload_is_registered_and_real_traces_give_sessions():
    assert "mooncake-sessions" in WORKLOADS
    out = WORKLOADS["mooncake-sessions"](cap=400, token_scale=0.05)
    follow = [r for r in out if r.step]
    assert follow and all(r.depends_on_previous for r in follow)
    assert len(out) == 400


def test_first_sessions_takes_whole_sessions_in_arrival_order():
    _, out = plan(
        rows(
            (0, 6, [1, 2]),  # session A: t:1 -> t:3 -> t:5
            (50, 5, [7, 8]),  # B: t:2, alone
            (100, 11, [1, 2, 3]),
            (150, 5, [9, 10]),  # C: t:4 -> t:6
            (200, 15, [1, 2, 3, 4]),
            (250, 9, [9, 10, 11]),
        )
    )
    sessions = lambda rs: {r.session_id for r in rs}  # noqa: E731
    by = {r.request_id: r for r in out}
    a, b, c = (by[f"t:{i}"].session_id for i in (1, 2, 4))
    # A's three steps reach 2 at once; 4 needs B too; 5 needs C (never a session cut).
    assert sessions(first_sessions(out, 2)) == {a}
    assert sessions(first_sessions(out, 4)) == {a, b}
    picked = first_sessions(out, 5)
    assert sessions(picked) == {a, b, c} and len(picked) == 6
    assert picked == [r for r in out if r in picked]  # the input's order
    with pytest.raises(ValueError):
        first_sessions(out, 0)


def test_the_matrix_sessions_keep_their_follow_ups():
    # Sessions found in the whole trace, then cut: a third of the requests are follow-ups
    # (found in the trace's first rows only, a twentieth).
    out = M._base_requests("sessions", 8, quick=True)
    follow = sum(1 for r in out if r.step)
    assert len(out) >= 300 and follow >= 0.25 * len(out)
    firsts = {r.session_id for r in out if not r.step}
    assert {r.session_id for r in out} == firsts  # whole sessions only


def test_a_client_may_withhold_its_session_header():
    _, out = plan(rows((0, 6, [1, 2]), (100, 11, [1, 2, 3])))
    step = out[1]
    assert request_headers(step, None)["x-meshd-session-id"] == step.session_id
    assert "x-meshd-session-id" not in request_headers(step, None, context=False)
    assert ClientSettings().context_headers


# -- the matrix -----------------------------------------------------------------------------


def outcome(rid: str, task: str, step: int, endpoint: str, end: float, ok: bool = True):
    return RequestOutcome(
        request_id=rid,
        workload="w",
        tenant="t",
        task_key=task,
        step=step,
        planned_at_s=0.0,
        sent_at_s=end - 1.0,
        queued_s=0.0,
        ok=ok,
        error=None if ok else "timeout",
        status=200,
        ttft_s=0.1,
        e2e_s=1.0,
        output_tokens=10,
        prompt_tokens=100,
        cached_tokens=50 if step else 0,
        endpoint=endpoint,
    )


def test_scaled_arrivals_offer_the_load_asked_for():
    base = WORKLOADS["mooncake"](cap=200, token_scale=1.0)
    cap = M.capacity(("H100", "A100"))
    assert 1.3 < cap < 1.4  # an A100 prefills ~0.32x an H100
    for load in (0.5, 1.5):
        out = M.scaled(base, cap, load)
        span = out[-1].at_s - out[0].at_s
        assert M._work_s(out) / span == pytest.approx(load * cap, rel=1e-6)


def test_figures_and_compare():
    outs = [
        outcome("a0", "A", 0, "e0", 1.0),
        outcome("a1", "A", 1, "e0", 3.0),
        outcome("a2", "A", 2, "e1", 5.0),
        outcome("b0", "B", 0, "e1", 1.0),
        outcome("b1", "B", 1, "e1", 2.0, ok=False),
    ]
    reqs = []

    class Result:
        succeeded, requests_sent, cost_usd = 4, 5, 1.0

        class ttft:
            p90 = p99 = 0.1

        class e2e:
            p50 = 1.0

        hit_rate = 0.2

        class tasks:
            succeeded = 1

    f = M.figures("meshd-no-gpu", reqs, outs, Result)
    assert f.keep == pytest.approx(2 / 3)  # a1 kept, a2 moved, b1 kept
    assert f.task_success == 0.5 and f.makespan_p50 == pytest.approx((5.0 + 2.0) / 2)
    assert f.hit_rate == pytest.approx(100 / 400)  # ok answers only
    assert f.max_over_mean == pytest.approx(3 / 2.5)
    # Over every engine of the fleet: e2 and e3 served nothing.
    fleet = M.FleetSpec(gpus=("H100",) * 4)
    assert M.figures("meshd-no-gpu", reqs, outs, Result, fleet).max_over_mean == pytest.approx(
        3 / (5 / 4)
    )
    cell = {
        "label": "x",
        "variant": "centre",
        "cell": {"workload": "w"},
        "figures": [
            {**M.asdict(f), "policy": "meshd-no-gpu"},
            {**M.asdict(f), "policy": "round-robin", "ttft_p90": 0.2, "hit_rate": 0.5},
        ],
    }
    cmp = M.compare(cell)
    assert cmp["ttft_p90"]["ratio"] == pytest.approx(0.5) and cmp["ttft_p90"]["pass"]
    assert cmp["hit_rate"]["ratio"] == pytest.approx(0.5) and not cmp["hit_rate"]["pass"]
    assert cmp["served"]["meshd"] == pytest.approx(4 / 5)  # ok / sent, informational
    assert "| x |" in M.report([cell]) and "served" in M.report([cell])


def test_one_real_cell_runs_every_policy():
    res = M.run_cell(M.Cell("shared-prefix", engines=4), quick=True)
    pols = [f["policy"] for f in res["figures"]]
    assert pols == [*M.PEERS, M.MESHD, M.MESHD_ELASTIC]
    for f in res["figures"]:
        assert f["ok"] == f["sent"] > 0
    ca = next(f for f in res["figures"] if f["policy"] == "cache-aware")
    rr = next(f for f in res["figures"] if f["policy"] == "round-robin")
    assert ca["hit_rate"] > rr["hit_rate"]  # 16 shared prompts over 4 engines
