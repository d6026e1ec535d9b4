"""Deadlines on one loop timer (meshd/deadlines.py): each callback runs at its time, in any
order of adding, a cancelled one never runs, the timer is not re-armed for a later
deadline, and `timeout` behaves as asyncio.timeout (TimeoutError at its time, another
cancellation stays a cancellation)."""

from __future__ import annotations

import asyncio

import pytest

from meshd.deadlines import Deadlines


async def test_each_deadline_runs_at_its_time_in_any_order() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines()
    ran: list[tuple[str, float]] = []
    done = loop.create_future()

    def note(name: str) -> None:
        ran.append((name, loop.time()))
        if len(ran) == 3:
            done.set_result(None)

    now = loop.time()
    late = d.add(now + 0.06, note, "late")
    d.add(now + 0.02, note, "early")  # earlier than the armed time: the timer moves
    d.add(now + 0.04, note, "middle")
    await done
    assert [name for name, _ in ran] == ["early", "middle", "late"]
    for (_, at), want in zip(ran, (0.02, 0.04, 0.06), strict=True):
        assert at >= now + want - 1e-3  # never early
    assert late.when == pytest.approx(now + 0.06)
    assert len(d) == 0


async def test_a_cancelled_deadline_never_runs_and_the_timer_is_kept() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines()
    ran: list[str] = []
    done = loop.create_future()
    gone = d.add(loop.time() + 0.01, ran.append, "cancelled")
    handle = d._handle
    d.cancel(gone)
    d.add(loop.time() + 0.03, done.set_result, None)
    assert d._handle is handle  # a later deadline does not re-arm the timer
    await done
    assert ran == []
    d.close()
    assert d._handle is None and len(d) == 0


async def test_timeout_raises_timeout_error_at_its_time() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines()
    never = loop.create_future()
    with pytest.raises(TimeoutError):
        async with d.timeout(loop.time() + 0.02) as t:
            await never
    assert t.expired and len(d) == 0
    async with d.timeout(loop.time() + 10) as t:
        await asyncio.sleep(0)
    assert not t.expired and len(d) == 0


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines()
    entered = asyncio.Event()

    async def body() -> None:
        async with d.timeout(loop.time() + 10):
            entered.set()
            await loop.create_future()

    task = asyncio.create_task(body())
    await entered.wait()
    task.cancel()  # e.g. the client left
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(d) == 0


async def test_an_error_in_the_block_passes_through() -> None:
    d = Deadlines()
    loop = asyncio.get_running_loop()
    with pytest.raises(KeyError):
        async with d.timeout(loop.time() + 10):
            raise KeyError("x")
    assert len(d) == 0


async def test_an_unarmed_timeout_counts_from_arm() -> None:
    """`armed=False` (an attempt's first-byte timer, armed once its bytes are written): no
    deadline until `arm()`; then the same TimeoutError; arm() after the block does nothing."""
    loop = asyncio.get_running_loop()
    d = Deadlines()
    with d.timeout(loop.time(), armed=False) as t:
        await asyncio.sleep(0.01)  # past its time, but not armed
        assert len(d) == 0
    assert not t.expired
    t.arm()
    assert len(d) == 0
    never = loop.create_future()
    with pytest.raises(TimeoutError), d.timeout(loop.time() + 0.02, armed=False) as t:
        t.arm()
        await never
    assert t.expired and len(d) == 0
