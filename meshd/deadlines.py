"""Deadlines many requests set and almost never reach (the first byte's, an idle keep-alive
connection's), kept on one loop timer instead of a timer each: arming and cancelling a
uvloop timer costs ~3.5 us (a libuv timer made, started, stopped and closed), twice a
request before this. The set's timer is re-armed only when a deadline earlier than the one
it waits for comes in, so with one timeout for every request it fires about once per
timeout period, however many requests pass; a deadline still runs its callback at its time.

`Deadlines.timeout(when)` is an `asyncio.timeout` on this set: the same TimeoutError, and
the same care that a cancellation from elsewhere (the client left) stays a cancellation.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["Deadline", "Deadlines"]


class Deadline:
    """One deadline in a set: `callback(*args)` runs at loop time `when` unless cancelled."""

    __slots__ = ("args", "callback", "when")

    def __init__(self, when: float, callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.when = when
        self.callback = callback
        self.args = args


class Deadlines:
    """A set of deadlines on one event loop timer (see the module docstring)."""

    __slots__ = ("_armed_at", "_entries", "_handle", "_loop")

    def __init__(self) -> None:
        self._entries: set[Deadline] = set()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, when: float, callback: Callable[..., None], *args: Any) -> Deadline:
        """`callback(*args)` at loop time `when` (on the running loop), unless `cancel`led."""
        entry = Deadline(when, callback, args)
        self._entries.add(entry)
        if when < self._armed_at:
            self._arm(when)
        return entry

    def cancel(self, entry: Deadline) -> None:
        # The timer stays: it finds nothing due when it fires, and waits for what is left.
        self._entries.discard(entry)

    def timeout(self, when: float, *, armed: bool = True) -> Timeout:
        """A context manager (async, or plain `with` inside a task): TimeoutError if its
        body is still running at `when`. `armed=False`: the deadline counts only from
        `Timeout.arm()` on (a body that arms it once its first bytes are written)."""
        return Timeout(self, when, armed)

    def close(self) -> None:
        """Forget every deadline and stop the timer."""
        self._entries.clear()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed_at = math.inf

    def _arm(self, when: float) -> None:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        if self._handle is not None:
            self._handle.cancel()
        self._armed_at = when
        self._handle = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._armed_at = math.inf
        assert self._loop is not None
        now = self._loop.time()
        due = [e for e in self._entries if e.when <= now]
        for entry in due:
            self._entries.discard(entry)
        for entry in due:
            entry.callback(*entry.args)
        if self._entries and self._handle is None:
            self._arm(min(e.when for e in self._entries))


class Timeout:
    """`asyncio.timeout(when)` on a Deadlines set: the task is cancelled at `when`, and the
    cancellation leaves the block as TimeoutError; one from elsewhere stays what it was."""

    __slots__ = ("_armed", "_cancelling", "_deadlines", "_entry", "_expired", "_task", "_when")

    def __init__(self, deadlines: Deadlines, when: float, armed: bool = True) -> None:
        self._deadlines = deadlines
        self._when = when
        self._armed = armed
        self._entry: Deadline | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._expired = False

    def __enter__(self) -> Timeout:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Timeout should be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        if self._armed:
            self._entry = self._deadlines.add(self._when, self._expire)
        return self

    def arm(self) -> None:
        """Start counting (a timeout made with `armed=False`, inside its block); once."""
        if not self._armed and self._task is not None:
            self._armed = True
            self._entry = self._deadlines.add(self._when, self._expire)

    async def __aenter__(self) -> Timeout:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._armed = True  # a late arm() finds the block left
        if self._entry is not None:
            self._deadlines.cancel(self._entry)
            self._entry = None
        if self._expired:
            assert self._task is not None
            # As asyncio.timeout: our cancellation becomes TimeoutError, only if no one
            # else asked the task to stop meanwhile.
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
        return None

    @property
    def expired(self) -> bool:
        return self._expired

    def _expire(self) -> None:
        self._entry = None
        assert self._task is not None
        self._expired = True
        self._task.cancel()
