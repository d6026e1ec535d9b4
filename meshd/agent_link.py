"""The agent's link to one control plane: the latest body of each resource, sent by its own
task with backoff, so a control plane that is down or slow never holds up the others; a full
PrefixDigest is never displaced unsent by the deltas built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from xds.client import Publisher
from xds.publish_frames import FramePublisher, frames_target

if TYPE_CHECKING:
    from meshd.agent import AgentStats

log = logging.getLogger("meshd.agent")

# After the frames port failed before it answered once (blocked, refused our certificate,
# not routed by the Service), the link stays on gRPC this long before it tries it again.
FRAMES_RETRY_S = 300.0
FRAMES_CONNECT_TIMEOUT_S = 5.0


class LinkOwner(Protocol):
    """What a link reports to and takes its settings from: one EngineAgent, or a NodeAgent
    whose engines share the link (meshd/node_agent.py)."""

    stats: AgentStats
    credentials: grpc.ChannelCredentials | None
    ssl_context: ssl.SSLContext | None  # the same TLS for the frames port
    config: Any  # .backoff: xds.client.Backoff; .publish_frames: bool

    def on_link_lost(self) -> None: ...


class ControlPlaneLink:
    """One control plane: the latest body of each resource, sent by its own task, so a
    control plane that is down or slow never holds up the others.

    Bodies offered while a send is in flight or the control plane is away coalesce to the
    latest, except that a body later ones build on (a full PrefixDigest: the deltas after
    it are relative to it) is never displaced by them unsent: it goes first, then the
    newest delta, so the control plane never holds a delta whose base it was not given.

    A link starts on gRPC; once the control plane advertises its frames publish port
    (xds/publish_frames.py: a publish there costs it a fifth as much) and the owner's
    config.publish_frames allows, the link connects there in the background (its sends go
    on over gRPC meanwhile) and moves there between two sends; back to gRPC when that port
    fails before it answered once, for FRAMES_RETRY_S."""

    def __init__(self, agent: LinkOwner, target: str, *, window_s: float = 0.0) -> None:
        """`window_s`: how long a send waits after the first body is offered, so the
        bodies its other engines offer in that window go in the same message (a link
        shared by a node's engines; a publish message costs the control plane ~120 us
        of gRPC whatever it carries: loadtest/xds_ingest_bench.py)."""
        self.agent = agent
        self.target = target
        self.window_s = window_s
        self.connected = False
        self._pending: dict[tuple[str, str], bytes] = {}
        self._bases: set[tuple[str, str]] = set()  # pending bodies that later ones build on
        self._first: dict[tuple[str, str], bytes] = {}  # displaced bases, sent before pending
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._rng = random.Random()
        self.transport = "grpc"  # what the last send went over: "grpc" or "frames"
        self._frames_retry_at = float("-inf")
        self._dialing: asyncio.Task[FramePublisher] | None = None

    def offer(self, type_url: str, name: str, body: bytes, *, base: bool = False) -> None:
        """`base`: bodies offered later for this resource build on this one."""
        self._put((type_url, name), body, base)
        self._wake.set()

    def _put(self, key: tuple[str, str], body: bytes, base: bool) -> None:
        if base:
            self._first.pop(key, None)  # a newer base supersedes everything before it
            self._bases.add(key)
        elif key in self._bases:
            self._first[key] = self._pending[key]
            self._bases.discard(key)
        self._pending[key] = body

    def _requeue(
        self,
        first: dict[tuple[str, str], bytes],
        batch: dict[tuple[str, str], bytes],
        bases: set[tuple[str, str]],
    ) -> None:
        """Put back what did not go, in front of what was offered meanwhile (replayed on
        top, so newer bodies win and a newer base supersedes the old ones)."""
        newer = self._first, self._pending, self._bases
        self._first, self._pending, self._bases = dict(first), dict(batch), set(bases)
        newer_first, newer_pending, newer_bases = newer
        for key, body in newer_pending.items():
            if key in newer_first:
                self._put(key, newer_first[key], True)
            self._put(key, body, key in newer_bases)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        # The flag as well as the cancel: a cancel that lands as an await completes can
        # be lost (3.11's wait_for returned the result instead), and the loop must still end.
        self._closed = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _dial(self, publisher: Publisher) -> None:
        """Connect to the frames port `publisher`'s stream advertised, in the background,
        where allowed and not failed lately."""
        port = publisher.frames_port
        if port is None or self._dialing is not None:
            return
        if not getattr(self.agent.config, "publish_frames", True):
            return
        where = frames_target(self.target, port)
        if where is None or asyncio.get_running_loop().time() < self._frames_retry_at:
            return
        frames = FramePublisher(*where, ssl_context=self.agent.ssl_context)

        async def connect() -> FramePublisher:
            try:
                async with asyncio.timeout(FRAMES_CONNECT_TIMEOUT_S):
                    await frames.connect()
            except BaseException:
                await frames.close()
                raise
            return frames

        self._dialing = asyncio.ensure_future(connect())

    async def _take_frames(self, publisher: Publisher) -> Publisher | FramePublisher:
        """The frames publisher once connected (the gRPC one closed), else `publisher`."""
        task = self._dialing
        if task is None or not task.done():
            return publisher
        self._dialing = None
        try:
            frames = task.result()
        except Exception as exc:
            log.info("control plane %s: frames port: %s; staying on gRPC", self.target, exc)
            self._frames_retry_at = asyncio.get_running_loop().time() + FRAMES_RETRY_S
            return publisher
        with contextlib.suppress(Exception):
            await publisher.close()
        log.info("control plane %s: publishing over frames on port %d", self.target, frames.port)
        return frames

    async def _stop_dialing(self) -> None:
        task, self._dialing = self._dialing, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(BaseException):
            frames = await task
            await frames.close()

    async def _publish(
        self, publisher: Publisher | FramePublisher, batch: dict[tuple[str, str], bytes]
    ) -> None:
        by_type: dict[str, dict[str, bytes]] = {}
        for (type_url, name), body in batch.items():
            by_type.setdefault(type_url, {})[name] = body
        for type_url, resources in by_type.items():
            # asyncio.timeout, not wait_for: see close().
            async with asyncio.timeout(5.0):
                await publisher.publish(type_url, resources)
            self.agent.stats.publish_messages += 1
        self.agent.stats.publishes += len(batch)

    async def _run(self) -> None:
        attempt = 0
        publisher: Publisher | FramePublisher | None = None
        try:
            while True:
                await self._wake.wait()
                if self.window_s > 0.0:
                    await asyncio.sleep(self.window_s)
                self._wake.clear()
                if self._closed:
                    return
                first, self._first = self._first, {}
                batch, self._pending = self._pending, {}
                bases, self._bases = self._bases, set()
                if publisher is None:
                    publisher = Publisher(self.target, credentials=self.agent.credentials)
                elif isinstance(publisher, Publisher):
                    publisher = await self._take_frames(publisher)
                try:
                    if first:
                        await self._publish(publisher, first)
                        first = {}
                    await self._publish(publisher, batch)
                    self.transport = "grpc" if isinstance(publisher, Publisher) else "frames"
                    if not self.connected:
                        self.connected = True
                        log.info("publishing to the control plane %s", self.target)
                    attempt = 0
                    if isinstance(publisher, Publisher):
                        self._dial(publisher)
                except Exception as exc:
                    self.agent.stats.publish_failures += 1
                    if isinstance(publisher, FramePublisher) and not publisher.answers:
                        self._frames_retry_at = asyncio.get_running_loop().time() + FRAMES_RETRY_S
                    if self.connected:
                        log.warning("control plane %s: %s; retrying", self.target, exc)
                    self.connected = False
                    with contextlib.suppress(Exception):
                        await publisher.close()
                    publisher = None
                    await self._stop_dialing()
                    # Keep what did not go, and make the next digest full: this control
                    # plane may have lost the base.
                    self._requeue(first, batch, bases)
                    self.agent.on_link_lost()
                    await asyncio.sleep(self.agent.config.backoff.delay(attempt, self._rng))
                    attempt += 1
                    self._wake.set()
        finally:  # closed, or cancelled: either way the channel goes
            await self._stop_dialing()
            if publisher is not None:
                with contextlib.suppress(Exception):
                    await publisher.close()
