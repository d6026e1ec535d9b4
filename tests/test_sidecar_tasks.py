"""Task-step headers through the sidecar: a task whose client says which step is which
(x-meshd-task-step / -steps / -final) closes as a success when its final step succeeds,
not after the ledger's idle timeout; untrusted clients' step headers are stripped."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
from backends import TestBackend as Backend
from harness import sidecar_config, url

from meshd.sidecar import Sidecar


def tasks(s: Sidecar, outcome: str) -> float:
    return (
        s.metrics.registry.get_sample_value(
            "meshd_tasks_total", {"pool": "default", "outcome": outcome}
        )
        or 0.0
    )


async def step(s: Sidecar, task: str, n: int, of: int, **extra: str) -> None:
    headers = {
        "x-meshd-task-id": task,
        "x-meshd-task-step": str(n),
        "x-meshd-task-steps": str(of),
        **extra,
    }
    body = {"model": "m", "prompt": f"{task} step {n}", "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url(s, "/v1/completions"), json=body, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        await r.read()


async def test_the_final_step_closes_the_task(
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    b = await backends("b0")
    s = await sidecar(sidecar_config([b.url]))
    await step(s, "t1", 0, 3)
    await step(s, "t1", 1, 3)
    assert tasks(s, "success") == 0  # two of three steps: still open
    await step(s, "t1", 2, 3)
    assert tasks(s, "success") == 1
    # `final` decides over the count: an agent that finishes early.
    await step(s, "t2", 0, 5)
    await step(s, "t2", 1, 5, **{"x-meshd-task-final": "true"})
    assert tasks(s, "success") == 2
    cps = s.metrics.registry.get_sample_value("meshd_cost_per_successful_task_usd")
    assert cps is not None and cps >= 0


async def test_a_bad_step_is_a_400_naming_the_header(
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    b = await backends("b0")
    s = await sidecar(sidecar_config([b.url]))
    body = {"model": "m", "prompt": "x", "max_tokens": 4}
    headers = {"x-meshd-task-id": "t", "x-meshd-task-step": "5", "x-meshd-task-steps": "5"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url(s, "/v1/completions"), json=body, headers=headers) as r,
    ):
        assert r.status == 400
        assert "x-meshd-task-step" in (await r.json())["error"]["message"]
