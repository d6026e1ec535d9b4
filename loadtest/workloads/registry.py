"""Named workloads for the benchmark CLI: name -> function of keyword arguments -> requests.

Trace entries take traces_dir (resolved by `traces.traces_dir`), cap, time_scale, token_scale, seed
and strict; generator entries take their generator's keywords.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

from loadtest.workloads.generators import agentic, mix, multi_turn, shared_prefix
from loadtest.workloads.request import PlannedRequest
from loadtest.workloads.tenants import DEMO_TENANTS
from loadtest.workloads.traces import (
    AZURE_CODE,
    AZURE_CONV,
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_SYNTHETIC,
    mooncake_sessions,
    read_azure,
    read_mooncake,
)
from loadtest.workloads.traces import traces_dir as resolve_traces_dir

PathArg = str | os.PathLike[str] | None

# The full synthetic trace averages 15k-token prompts; 0.05 keeps its sharing structure
# at ~770 tokens a prompt, which a small simulated fleet serves in minutes.
MOONCAKE_TOKEN_SCALE = 0.05


def mooncake(
    *,
    traces_dir: PathArg = None,
    cap: int | None = None,
    skip: int = 0,
    time_scale: float = 1.0,
    token_scale: float = MOONCAKE_TOKEN_SCALE,
    seed: int = 0,
    strict: bool = True,
) -> list[PlannedRequest]:
    """Mooncake's synthetic trace (synthetic_trace.jsonl), shrunk by token_scale; `skip`
    drops the first rows (a window of the trace: rows skip .. skip + cap)."""
    path = resolve_traces_dir(traces_dir) / MOONCAKE_SYNTHETIC
    rows = read_mooncake(
        path, None if cap is None else skip + cap, time_scale, token_scale, seed, strict
    )
    if skip:
        rows = rows[skip:]
        origin = rows[0].at_s if rows else 0.0
        rows = [replace(r, at_s=r.at_s - origin) for r in rows]
    return rows


def mooncake_sessions_workload(
    *,
    traces_dir: PathArg = None,
    cap: int | None = None,
    skip: int = 0,
    time_scale: float = 1.0,
    token_scale: float = MOONCAKE_TOKEN_SCALE,
    seed: int = 0,
    strict: bool = True,
    think_s: float = 2.0,
    max_steps: int = 8,
) -> list[PlannedRequest]:
    """Mooncake's conversations as closed-loop sessions (traces.mooncake_sessions): the
    trace's arrivals start sessions, each next turn goes `think_s` after the answer."""
    rows = mooncake(
        traces_dir=traces_dir,
        cap=cap,
        skip=skip,
        time_scale=time_scale,
        token_scale=token_scale,
        seed=seed,
        strict=strict,
    )
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * token_scale))
    return mooncake_sessions(rows, think_s=think_s, max_steps=max_steps, block_tokens=block)


def azure_code(
    *,
    traces_dir: PathArg = None,
    cap: int | None = None,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    seed: int = 0,
    strict: bool = True,
) -> list[PlannedRequest]:
    """Azure's code-completion trace (one hour, very bursty)."""
    return read_azure(
        resolve_traces_dir(traces_dir) / AZURE_CODE, cap, time_scale, token_scale, seed, strict
    )


def azure_conv(
    *,
    traces_dir: PathArg = None,
    cap: int | None = None,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    seed: int = 0,
    strict: bool = True,
) -> list[PlannedRequest]:
    """Azure's conversation trace (one hour)."""
    return read_azure(
        resolve_traces_dir(traces_dir) / AZURE_CONV, cap, time_scale, token_scale, seed, strict
    )


def demo(*, seed: int = 0, load: float = 1.0, duration_s: float = 60.0) -> list[PlannedRequest]:
    """A shared-prefix + agentic mix for 8 small engines over ~duration_s at modest load.

    At load 1.0: ~4 questions/s over 8 system prompts of 512 tokens, plus ~1 agentic task
    every 3 s (3-7 steps of 96 tokens after a 384-token shared tool prompt, 30 s task
    deadline); ~6 requests/s in all, under 1 request/s per engine. `load` scales the
    rates and counts together, so the duration stays about the same. Tenants gold/silver/
    bronze (priorities 9/5/1, weights 1/2/3).
    """
    if not (load > 0 and duration_s > 0):
        raise ValueError("load and duration_s must be > 0")
    question_rate = 4.0 * load
    task_rate = load / 3.0
    questions = shared_prefix(
        groups=8,
        questions_per_group=max(1, round(question_rate * duration_s / 8)),
        system_prompt_tokens=512,
        question_tokens=48,
        max_tokens=64,
        rate=question_rate,
        seed=seed,
        tenants=DEMO_TENANTS,
        name="demo-shared-prefix",
    )
    tasks = agentic(
        tasks=max(1, round(task_rate * duration_s)),
        steps=(3, 7),
        step_tokens=96,
        deadline_ms=30_000,
        system_prompt_tokens=384,
        max_tokens=48,
        think_s=0.5,
        rate=task_rate,
        seed=seed,
        tenants=DEMO_TENANTS,
        name="demo-agentic",
    )
    return mix(questions, tasks)


WORKLOADS: dict[str, Callable[..., list[PlannedRequest]]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "agentic": agentic,
    "mooncake": mooncake,
    "mooncake-sessions": mooncake_sessions_workload,
    "azure-code": azure_code,
    "azure-conv": azure_conv,
    "demo": demo,
}
