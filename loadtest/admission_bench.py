"""The admission path's own cost per request, in process, on the sidecar's own objects (the
default config's router, guard and retry budget for a pool of two engines): the router's
order (the picker's pick and the routes built), the throttle's check alone, admit (the
admission item, the throttle, admission's offer), the guard's breaker screen of the
routes, the retry budget's deposit; then the guard's part of the attempt (started,
first_token, finished) and, after the answer, the slot's release and the pump. Warm
(back to back) and cold (the caches flushed by copying 32 MB before each part, as a
sidecar finds them after ~10 ms of other work), p50 and p90 in us.

Run: `python -m loadtest.admission_bench [--requests 3000] [--cold 600]`. Run it in two
trees (old and new, alternating) to compare: the figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import inspect
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from filters.pool_router import admission_item
from filters.request import parse_inference_request
from filters.routing_headers import RoutingHeaders
from loadtest.openloop import Endpoint, completion_request
from loadtest.overhead import meshd_config
from meshd.config import load_config
from meshd.pools import build_routers, guards, retry_budgets

_FLUSH = bytearray(32 << 20)
PARTS = (
    "order",
    "throttle",
    "admit",
    "screen",
    "budget",
    "pre-send",
    "started",
    "first",
    "finished",
    "after",
)


def _flush() -> None:
    bytes(_FLUSH)


def run(requests: int, cold: bool) -> dict[str, list[float]]:
    eps = [Endpoint("127.0.0.1", 9001), Endpoint("127.0.0.1", 9002)]
    config = load_config(base=meshd_config(eps), env={})
    routers = build_routers(config)
    pool = config.pools[0].name
    router, guard, budget = (
        routers[pool],
        guards(config, routers)[pool],
        retry_budgets(config)[pool],
    )
    rng = random.Random(1)
    body = completion_request(1).body
    inference = parse_inference_request("completion", body)
    headers = RoutingHeaders()
    from filters.hotpath import block_hashes
    from filters.picker import PickRequest

    hashes = block_hashes(inference.prompt_text, inference.model, "", 64)
    # The sidecar screens for its first try only (limit=1) where the guard can (not before).
    first: dict[str, Any] = (
        {"limit": 1} if "limit" in inspect.signature(guard.screen).parameters else {}
    )
    out: dict[str, list[float]] = {p: [] for p in PARTS}
    clock: Callable[[], int] = time.perf_counter_ns
    for i in range(requests):
        now = time.monotonic()
        pick = PickRequest.build(inference, headers, now, block_hashes=hashes)
        tokens = guard.expected_tokens(pick.model, pick.prompt_tokens, inference.max_tokens)
        if cold:
            _flush()
        to = clock()
        routes = router.order(pick, now)
        tp = clock()
        throttle = guard.throttle
        if cold:
            _flush()
        ta = clock()
        assert throttle is None or throttle.allow(now, rng)
        tb = clock()
        if cold:
            _flush()
        t0 = clock()
        item = admission_item(i, router, pick, None, tokens, now)
        decision = guard.gate(item, now, rng)
        t1 = clock()
        screened = guard.screen(routes, tokens, pick.priority, now, **first)
        t2 = clock()
        budget.deposit(now)
        t3 = clock()
        assert type(decision).__name__ == "Admit" and screened.routes, (decision, screened)
        route = screened.routes[0]
        router.started(route, i, pick, now)
        if cold:
            _flush()
        t4 = clock()
        guard.started(route.url, i, tokens, now, model=pick.model)
        t5 = clock()
        if cold:
            _flush()
        t6 = clock()
        guard.first_token(i, now + 0.001)
        t7 = clock()
        router.finished(route, i, pick, now + 0.002, ok=True, completion_tokens=1)
        if cold:
            _flush()
        t8 = clock()
        guard.finished(route.url, i, now + 0.002, status=200, completion_tokens=1)
        t9 = clock()
        if cold:
            _flush()
        t10 = clock()
        guard.release(item.id, now + 0.002)
        guard.pump(now + 0.002)
        t11 = clock()
        spans = (
            tp - to,
            tb - ta,
            t1 - t0,
            t2 - t1,
            t3 - t2,
            t3 - t0,
            t5 - t4,
            t7 - t6,
            t9 - t8,
            t11 - t10,
        )
        for part, ns in zip(PARTS, spans, strict=True):
            out[part].append(ns / 1e3)
    return out


def _q(values: Sequence[float], f: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(f * len(s)))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.admission_bench", description=__doc__)
    parser.add_argument("--requests", type=int, default=3000, help="warm requests")
    parser.add_argument("--cold", type=int, default=600, help="cold requests (0: none)")
    args = parser.parse_args(argv)
    from filters import hotpath

    print(f"hot path: {hotpath.IMPLEMENTATION}; {getattr(hotpath, 'ADMISSION', 'python')}")
    for label, n, cold in (("warm", args.requests, False), ("cold", args.cold, True)):
        if n <= 0:
            continue
        res = run(n, cold)
        cells = ", ".join(f"{p} {_q(res[p], 0.5):.1f}/{_q(res[p], 0.9):.1f}" for p in PARTS)
        print(f"{label} ({n} requests) p50/p90 us: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
