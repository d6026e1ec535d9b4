"""The sidecar's admin listener (aiohttp; loopback unless configured): /healthz, /readyz,
/metrics (Prometheus), /config (the effective config) and /endpoints (each pool's routing
state, as the picker sees it)."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from filters.hotpath import IMPLEMENTATION

if TYPE_CHECKING:
    from meshd.sidecar import Sidecar


# Keys whose values are secrets, wherever they sit; and maps whose every value may be one
# (telemetry.tracing.headers: an exporter's Authorization, API keys).
_SECRET_KEY = re.compile(
    r"(?i)^(.*[-_])?(authori[sz]ation|token|secret|password|passwd|api[-_]?key|cookie)$"
)
_SECRET_MAPS = frozenset({"headers"})
REDACTED = "<redacted>"


def redact(doc: Any, key: str = "") -> Any:
    """The effective config as /config shows it: every secret-bearing value replaced by
    `<redacted>` (the key stays, so an operator sees that one is set)."""
    if isinstance(doc, dict):
        if key in _SECRET_MAPS:
            return {k: REDACTED for k in doc}
        return {k: REDACTED if v and _SECRET_KEY.match(k) else redact(v, k) for k, v in doc.items()}
    if isinstance(doc, list):
        return [redact(v, key) for v in doc]
    return doc


PROBES_APP: web.AppKey[web.Application] = web.AppKey("probes", web.Application)


def build_admin_app(sidecar: Sidecar) -> web.Application:
    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        now = time.monotonic()
        pools = {
            name: sum(1 for ep in b.snapshot(now) if ep["healthy"])
            for name, b in sidecar.routers.items()
        }
        problems = [f"pool {n!r} has no healthy endpoint" for n, c in pools.items() if c == 0]
        if sidecar.draining:
            problems.insert(0, "draining")
        body: dict[str, Any] = {
            "ready": not problems,
            "problems": problems,
            "healthy_endpoints": pools,
        }
        feed = sidecar.control_feed
        if feed is not None:
            # Said, not counted: a stale control plane leaves the sidecar routing on its
            # own observations (static stability), so it does not make it unready.
            body["control_plane"] = feed.health()
        return web.json_response(body, status=503 if problems else 200)

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(sidecar.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def config(request: web.Request) -> web.Response:
        return web.json_response(redact(sidecar.config.model_dump(mode="json")))

    async def endpoints(request: web.Request) -> web.Response:
        now = time.monotonic()
        cpt = sidecar.chars_per_token
        return web.json_response(
            {
                "hot_path": IMPLEMENTATION,
                "active_requests": sidecar.active,
                "policy": sidecar.config.routing.policy,
                "pools": {name: b.snapshot(now) for name, b in sidecar.routers.items()},
                "kv_events": {name: p.snapshot() for name, p in sidecar.precise.items()},
                "chars_per_token": None if cpt is None else cpt.snapshot(),
            }
        )

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/config", config)
    app.router.add_get("/endpoints", endpoints)
    probes = web.Application()  # listeners.probes: the same handlers, fewer of them
    probes.router.add_get("/healthz", healthz)
    probes.router.add_get("/readyz", readyz)
    if sidecar.config.listeners.probes.metrics:
        probes.router.add_get("/metrics", metrics)
    app[PROBES_APP] = probes
    return app
