"""The sidecar's half of the loop to the autoscaler: every PUBLISH_INTERVAL_S, each pool's
demand as this sidecar sees it (meshd/autoscale_metrics.py PoolSignals) goes to every
control plane it knows, every replica of every shard, as a PoolDemandReport
(xds/resources.py), so whichever control plane an autoscaler asks sums the whole fleet's
demand into one figure per pool (docs/autoscaling.md). A control plane that is away misses
a report; the next one, a few seconds later, carries the window again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from typing import Any

import grpc

from filters.autoscale import ScalingPolicy, policy_from
from meshd.autoscale_metrics import PoolSignals
from xds.client import Publisher
from xds.resources import POOL_DEMAND_TYPE, PoolDemandReport, report_name

__all__ = ["PUBLISH_INTERVAL_S", "DemandPublisher"]

log = logging.getLogger("meshd.sidecar")

# A sixth of the control plane's report age limit (REPORT_MAX_AGE_S, 30 s): a report or two
# lost does not drop the sidecar from the sum.
PUBLISH_INTERVAL_S = 5.0
# One publish may take this long before that control plane is skipped this round.
PUBLISH_TIMEOUT_S = 2.0


class DemandPublisher:
    def __init__(
        self,
        config: Any,
        signals: PoolSignals,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        sidecar_id: str | None = None,
        interval_s: float = PUBLISH_INTERVAL_S,
    ) -> None:
        cp = config.control_plane
        self.targets = sorted({a for shard in cp.shard_list() for a in shard})
        # Unique per process: two sidecars on one host (or one restarted) are two reports.
        self.sidecar_id = sidecar_id or (
            f"{cp.node_id or socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        )
        self.signals = signals
        self.interval_s = interval_s
        self.policies: dict[str, ScalingPolicy] = {
            p.name: policy_from(p.autoscaling) for p in config.pools
        }
        self._credentials = credentials
        self._publishers: dict[str, Publisher] = {}
        self._task: asyncio.Task[None] | None = None
        self.published = 0  # reports accepted, over all control planes
        self.failed = 0

    def reports(self, now: float) -> dict[str, bytes]:
        """This sidecar's report for each pool, by resource name."""
        out = {}
        for pool, (demand, _) in self.signals.evaluate(now, force=True).items():
            r = PoolDemandReport(pool, self.sidecar_id, demand, self.policies[pool])
            out[r.name] = r.encode()
        return out

    def _publisher(self, target: str) -> Publisher:
        pub = self._publishers.get(target)
        if pub is None:
            pub = self._publishers[target] = Publisher(target, credentials=self._credentials)
        return pub

    async def _send(self, target: str, bodies: dict[str, bytes], removed: list[str]) -> bool:
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                await self._publisher(target).publish(POOL_DEMAND_TYPE, bodies, removed)
            return True
        except Exception as exc:  # the control plane away, slow or refusing: next round
            log.debug("demand report to %s failed: %s", target, exc)
            pub = self._publishers.pop(target, None)
            if pub is not None:
                with contextlib.suppress(Exception):
                    await pub.close()
            return False

    async def publish_once(self) -> int:
        """Every pool's report to every control plane now; how many accepted it."""
        bodies = self.reports(time.monotonic())
        if not bodies or not self.targets:
            return 0
        results = await asyncio.gather(*(self._send(t, bodies, []) for t in self.targets))
        ok = sum(results)
        self.published += ok
        self.failed += len(results) - ok
        return ok

    async def _loop(self) -> None:
        while True:
            await self.publish_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None and self.targets:
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        """Stop, and withdraw this sidecar's reports (best effort: else they age out)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        names = [report_name(p, self.sidecar_id) for p in self.policies]
        live = [t for t in self.targets if t in self._publishers]
        await asyncio.gather(*(self._send(t, {}, names) for t in live))
        for pub in self._publishers.values():
            with contextlib.suppress(Exception):
                await pub.close()
        self._publishers.clear()
