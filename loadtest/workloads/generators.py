"""Synthetic workload generators: shared-prefix groups, multi-turn chat, agentic tasks, mix.

Every generator is a pure function of its arguments: a `random.Random(seed)` drives all
draws, block ids are namespaced by (name, seed, ...), and the result is sorted by at_s
with the steps of a chain in step order. Same arguments, same list.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from loadtest.workloads.arrivals import Burst, arrival_times
from loadtest.workloads.request import Kind, Message, PlannedRequest
from loadtest.workloads.tenants import DEFAULT_TENANTS, Tenant, check_tenants, pick_tenant
from loadtest.workloads.text import count_tokens, join_text, segment

# vLLM's default KV block size; the prefix-hash block of meshd's picker.
DEFAULT_BLOCK_TOKENS = 16

Count = int | tuple[int, int]


def _draw_count(rng: random.Random, count: Count, what: str) -> int:
    """`count` itself, or uniform in [lo, hi] for a (lo, hi) pair."""
    if isinstance(count, tuple):
        lo, hi = count
        if not 1 <= lo <= hi:
            raise ValueError(f"{what} range must satisfy 1 <= lo <= hi, got {count}")
        return rng.randint(lo, hi)
    if count < 1:
        raise ValueError(f"{what} must be >= 1, got {count}")
    return count


def _think(rng: random.Random, mean_s: float) -> float:
    return rng.expovariate(1 / mean_s) if mean_s > 0 else 0.0


def _check(**values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _sorted(requests: list[PlannedRequest]) -> list[PlannedRequest]:
    # Stable: requests are appended in step order, so equal at_s keeps each chain in order.
    requests.sort(key=lambda r: r.at_s)
    return requests


def _first_turn(
    kind: Kind, system: str, user: str
) -> tuple[str | None, tuple[Message, ...] | None, int]:
    if kind == "completion":
        prompt = join_text((system, user))
        return prompt, None, count_tokens(prompt)
    messages = ((Message("system", system),) if system else ()) + (Message("user", user),)
    return None, messages, count_tokens(system) + count_tokens(user)


def _next_turn(kind: Kind, user: str) -> tuple[str | None, tuple[Message, ...] | None]:
    if kind == "completion":
        return user, None
    return None, (Message("user", user),)


def shared_prefix(
    groups: int = 8,
    questions_per_group: int = 16,
    system_prompt_tokens: int = 512,
    question_tokens: int = 64,
    max_tokens: int = 64,
    rate: float = 4.0,
    seed: int = 0,
    *,
    burst: Burst | None = None,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    kind: Kind = "completion",
    deadline_ms: int | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    name: str = "shared-prefix",
) -> list[PlannedRequest]:
    """Independent questions sharing one of `groups` system prompts.

    groups * questions_per_group requests, the groups interleaved at random, arriving
    open-loop at `rate` per second (Poisson, or bursty with `burst`). Each prompt is the
    group's system prompt (system_prompt_tokens, identical text within a group) followed
    by a unique question (question_tokens). Tenants are drawn per request.
    """
    _check(
        groups=groups,
        questions_per_group=questions_per_group,
        system_prompt_tokens=system_prompt_tokens,
        question_tokens=question_tokens,
    )
    if question_tokens + system_prompt_tokens < 1:
        raise ValueError("a prompt needs at least one token")
    mix = check_tenants(tenants)
    rng = random.Random(seed)
    systems = [
        segment((name, seed, "system", g), system_prompt_tokens, block_tokens)
        for g in range(groups)
    ]
    order = [(g, q) for g in range(groups) for q in range(questions_per_group)]
    rng.shuffle(order)
    times = arrival_times(rate, len(order), rng, burst)
    out: list[PlannedRequest] = []
    for at_s, (g, q) in zip(times, order, strict=True):
        system_text, system_ids = systems[g]
        question, question_ids = segment(
            (name, seed, "question", g, q), question_tokens, block_tokens
        )
        prompt, messages, n_tokens = _first_turn(kind, system_text, question)
        tenant = pick_tenant(rng, mix)
        out.append(
            PlannedRequest(
                request_id=f"{name}-{seed}-g{g}-q{q}",
                workload=name,
                at_s=at_s,
                kind=kind,
                prompt=prompt,
                messages=messages,
                max_tokens=max_tokens,
                prompt_tokens=n_tokens,
                tenant=tenant.name,
                priority=tenant.priority,
                deadline_ms=deadline_ms,
                block_ids=system_ids + question_ids,
            )
        )
    return _sorted(out)


def _chains(
    *,
    name: str,
    seed: int,
    chains: int,
    steps: Count,
    system_prompt_tokens: int,
    shared_system_prompt: bool,
    first_tokens: int,
    step_tokens: int,
    max_tokens: int,
    think_s: float,
    rate: float,
    burst: Burst | None,
    tenants: Sequence[Tenant],
    kind: Kind,
    deadline_ms: int | None,
    task_deadline_ms: int | None,
    block_tokens: int,
    chain_label: str,
    agentic: bool,
) -> list[PlannedRequest]:
    """Chains of dependent requests: step 0 = system + first turn, step k = new turn."""
    _check(
        chains=chains,
        system_prompt_tokens=system_prompt_tokens,
        first_tokens=first_tokens,
        step_tokens=step_tokens,
        think_s=think_s,
    )
    if first_tokens < 1 or step_tokens < 1:
        raise ValueError("every turn needs at least one token")
    mix = check_tenants(tenants)
    rng = random.Random(seed)
    starts = arrival_times(rate, chains, rng, burst)
    shared = segment((name, seed, "system"), system_prompt_tokens, block_tokens)
    out: list[PlannedRequest] = []
    for c, start in enumerate(starts):
        chain_id = f"{name}-{seed}-{chain_label}{c}"
        n_steps = _draw_count(rng, steps, "steps")
        tenant = pick_tenant(rng, mix)
        system_text, context_ids = (
            shared
            if shared_system_prompt
            else segment((name, seed, "system", c), system_prompt_tokens, block_tokens)
        )
        at_s = start
        for k in range(n_steps):
            turn, turn_ids = segment(
                (name, seed, chain_label, c, k),
                first_tokens if k == 0 else step_tokens,
                block_tokens,
            )
            context_ids = context_ids + turn_ids
            think = 0.0
            if k == 0:
                prompt, messages, n_tokens = _first_turn(kind, system_text, turn)
            else:
                prompt, messages = _next_turn(kind, turn)
                n_tokens = count_tokens(turn)
                think = _think(rng, think_s)
                at_s += think
            out.append(
                PlannedRequest(
                    request_id=f"{chain_id}-step{k}",
                    workload=name,
                    at_s=at_s,
                    kind=kind,
                    prompt=prompt,
                    messages=messages,
                    max_tokens=max_tokens,
                    prompt_tokens=n_tokens,
                    tenant=tenant.name,
                    priority=tenant.priority,
                    session_id=None if agentic else chain_id,
                    task_id=chain_id if agentic else None,
                    step=k,
                    steps_in_task=n_steps,
                    deadline_ms=deadline_ms,
                    task_deadline_ms=task_deadline_ms,
                    depends_on_previous=k > 0,
                    think_s=think,
                    block_ids=context_ids,
                )
            )
    return _sorted(out)


def multi_turn(
    sessions: int = 16,
    turns: Count = 4,
    system_prompt_tokens: int = 256,
    user_tokens: int = 64,
    max_tokens: int = 128,
    think_s: float = 3.0,
    rate: float = 0.5,
    seed: int = 0,
    *,
    burst: Burst | None = None,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    kind: Kind = "chat",
    shared_system_prompt: bool = True,
    deadline_ms: int | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    name: str = "multi-turn",
) -> list[PlannedRequest]:
    """Chat sessions whose context grows turn by turn.

    Sessions start open-loop at `rate` per second. A session has `turns` turns (or a
    uniform draw from a (lo, hi) pair). Turn 0 carries the system prompt (shared by all
    sessions unless shared_system_prompt=False) and a user message of user_tokens; turn
    k >= 1 carries only its new user message and depends on turn k-1 (see PlannedRequest:
    the runner appends the previous answer), after an exponential think time of mean
    think_s. One tenant per session; session_id set, task_id None.
    """
    return _chains(
        name=name,
        seed=seed,
        chains=sessions,
        steps=turns,
        system_prompt_tokens=system_prompt_tokens,
        shared_system_prompt=shared_system_prompt,
        first_tokens=user_tokens,
        step_tokens=user_tokens,
        max_tokens=max_tokens,
        think_s=think_s,
        rate=rate,
        burst=burst,
        tenants=tenants,
        kind=kind,
        deadline_ms=deadline_ms,
        task_deadline_ms=None,
        block_tokens=block_tokens,
        chain_label="session",
        agentic=False,
    )


def agentic(
    tasks: int = 16,
    steps: Count = 5,
    step_tokens: int = 128,
    deadline_ms: int = 30_000,
    system_prompt_tokens: int = 512,
    max_tokens: int = 64,
    think_s: float = 0.5,
    rate: float = 0.5,
    seed: int = 0,
    *,
    burst: Burst | None = None,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    kind: Kind = "completion",
    step_deadline_ms: int | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    name: str = "agentic",
) -> list[PlannedRequest]:
    """Agentic tasks: N dependent steps whose prompts extend the previous context.

    Tasks start open-loop at `rate` per second. Step 0 is the agent's system prompt (tool
    definitions, shared by every task) plus a task description of step_tokens; step k >= 1
    is a tool result of step_tokens appended to step k-1's prompt and answer, sent after
    an exponential tool time of mean think_s. Every step carries task_deadline_ms =
    deadline_ms, the budget of the whole task from the send of step 0, and deadline_ms =
    step_deadline_ms. One tenant per task; task_id set, session_id None.
    """
    return _chains(
        name=name,
        seed=seed,
        chains=tasks,
        steps=steps,
        system_prompt_tokens=system_prompt_tokens,
        shared_system_prompt=True,
        first_tokens=step_tokens,
        step_tokens=step_tokens,
        max_tokens=max_tokens,
        think_s=think_s,
        rate=rate,
        burst=burst,
        tenants=tenants,
        kind=kind,
        deadline_ms=step_deadline_ms,
        task_deadline_ms=deadline_ms,
        block_tokens=block_tokens,
        chain_label="task",
        agentic=True,
    )


def mix(*workloads: Sequence[PlannedRequest]) -> list[PlannedRequest]:
    """Merge workloads by arrival time (stable: argument order, then each list's order).

    Raises ValueError if a request id occurs twice (e.g. the same generator and seed
    mixed with itself), since the runner keys chains and results by id.
    """
    seen: set[str] = set()
    merged: list[PlannedRequest] = []
    for workload in workloads:
        for r in workload:
            if r.request_id in seen:
                raise ValueError(f"request id {r.request_id!r} occurs in more than one workload")
            seen.add(r.request_id)
            merged.append(r)
    return _sorted(merged)
