"""Where the sidecar's per-request work goes, function by function: the sidecar runs in this
process (uvloop) in front of stub backends (their own processes), the load generator sends
N one-at-a-time streamed completions through it, and cProfile records only those N. The
load generator's own functions (loadtest/openloop.py) are in the profile too; read the
sidecar's (meshd/, filters/) beside them.

Run: `python -m loadtest.sidecar_profile [--requests 2000] [--tokens 1] [--sort tottime]
[--out FILE.prof]`. Also prints, without the profiler, the wall time per request of the
whole loop (client included) and the sidecar's own two hops before the first byte (the
request read -> its upstream send, the answer read -> the client write; loadtest.ttfb_hops
measures the same hops across processes, with the scheduler's share in them): back to back
(warm), and with `--gap-ms` of idle loop before each request (cold). At ttfb_hops' 100/s
the hops took ~3.5x their back-to-back time on the 2-vCPU VM of 2026-12, and so they do
here with a 10 ms gap, idle or busy with other work: the code and data of a request's way
gone cold in the caches between requests, not a wait for a CPU.
`--set routing.policy=round-robin` runs a sidecar config key as sidecar_instructions does.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from loadtest.openloop import Endpoint, LoadGenerator, completion_request
from loadtest.overhead import Child, meshd_config, process_settings, start_backends


class _Hops:
    """Times the sidecar's own two hops of each request (as loadtest.ttfb_hops names them,
    on the same four functions): the request read -> its upstream send, and the upstream's
    answer read -> the first write to the client. In one process with the client, on one
    loop, one request at a time: the sidecar's own work, without another process's."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, str]] = []
        self.pre: list[float] = []
        self.post: list[float] = []
        self._undo: list[tuple[type, str, object]] = []
        self.recording = False

    def install(self) -> None:
        from meshd import listener, upstream_connection

        for cls, name, tag in (
            (listener._Connection, "data_received", "srv_recv"),
            (listener._Connection, "write", "srv_write"),
            (upstream_connection.UpstreamConnection, "send", "up_send"),
            (upstream_connection.UpstreamConnection, "data_received", "up_recv"),
        ):
            orig = getattr(cls, name)
            self._undo.append((cls, name, orig))
            setattr(cls, name, self._probe(orig, tag))

    def _probe(self, orig: Any, tag: str) -> Any:
        # Installed before any connection is made (uvloop keeps a protocol's bound
        # data_received from its start); records only while `recording`.
        def probed(conn: Any, *a: Any, **k: Any) -> Any:
            if self.recording:
                self.marks.append((time.perf_counter_ns(), tag))
            return orig(conn, *a, **k)

        return probed

    def remove(self) -> None:
        for cls, name, orig in reversed(self._undo):
            setattr(cls, name, orig)
        self._undo.clear()

    def request_done(self) -> None:
        first: dict[str, int] = {}
        for ns, tag in self.marks:
            first.setdefault(tag, ns)
        self.marks.clear()
        if len(first) == 4:
            self.pre.append((first["up_send"] - first["srv_recv"]) / 1e3)
            self.post.append((first["srv_write"] - first["up_recv"]) / 1e3)

    def summary(self, what: str = "") -> str:
        def q(values: list[float], f: float) -> float:
            s = sorted(values)
            return s[min(len(s) - 1, int(f * len(s)))] if s else float("nan")

        pre, post = self.pre, self.post
        return (
            f"sidecar's own hops in process ({len(pre)} requests{what}): "
            f"srv_recv->up_send p50 {q(pre, 0.5):.1f} us p90 {q(pre, 0.9):.1f} us; "
            f"up_recv->srv_write p50 {q(post, 0.5):.1f} us p90 {q(post, 0.9):.1f} us"
        )


async def _drive(
    config_tree: dict[str, object],
    eps: Sequence[Endpoint],
    tokens: int,
    n: int,
    warmup: int,
    hops: _Hops,
    cold: _Hops | None = None,
    gap_s: float = 0.0,
) -> tuple[cProfile.Profile, float]:
    from meshd.config import load_config
    from meshd.sidecar import Sidecar

    hops.install()
    workdir = Path(tempfile.mkdtemp(prefix="meshd-profile-"))
    path = workdir / "meshd.yaml"
    path.write_text(yaml.safe_dump(config_tree, sort_keys=False))
    sidecar = Sidecar(load_config(path, env={}))
    await sidecar.start()
    gen = LoadGenerator(
        (Endpoint.parse(sidecar.addresses["outbound"]),), completion_request(tokens), timeout_s=30
    )
    prof = cProfile.Profile()
    try:
        for _ in range(warmup):
            await gen.one()
        t0 = time.perf_counter()
        for _ in range(n):
            sample = await gen.one()
            if not sample.ok:
                raise RuntimeError(f"a request failed: {sample}")
        wall = (time.perf_counter() - t0) / n
        hops.recording = True
        for _ in range(n):
            await gen.one()
            hops.request_done()
        hops.recording = False
        if cold is not None:
            # The same probes, another timer: requests after an idle gap.
            warm_pre, warm_post = hops.pre, hops.post
            hops.pre, hops.post = cold.pre, cold.post
            for _ in range(n):
                await asyncio.sleep(gap_s)
                hops.recording = True
                await gen.one()
                hops.recording = False
                hops.request_done()
            hops.pre, hops.post = warm_pre, warm_post
        prof.enable()
        for _ in range(n):
            await gen.one()
        prof.disable()
    finally:
        await gen.close()
        await sidecar.drain_and_stop()
        hops.remove()
        shutil.rmtree(workdir, ignore_errors=True)
    return prof, wall


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.sidecar_profile", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=10.0,
        help="idle loop time before each request of the cold hops (0: not measured)",
    )
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--limit", type=int, default=45)
    parser.add_argument("--out", help="write the pstats file here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    args = parser.parse_args(argv)
    import uvloop

    workdir = Path(tempfile.mkdtemp(prefix="meshd-profile-b-"))
    backends: list[Child] = []
    try:
        backends = start_backends(process_settings(tokens=args.tokens, backends=2), workdir)
        eps = [Endpoint("127.0.0.1", int(b.ready["port"])) for b in backends]
        tree = meshd_config(eps)
        tree["upstream"] = {"first_byte_timeout_s": 30}
        for item in args.set:
            key, _, value = item.partition("=")
            *parents, leaf = key.split(".")
            node = tree
            for name in parents:
                node = node.setdefault(name, {})
            node[leaf] = yaml.safe_load(value)
        hops = _Hops()
        cold = _Hops() if args.gap_ms > 0 else None
        prof, wall = uvloop.run(
            _drive(
                tree, eps, args.tokens, args.requests, args.warmup, hops, cold, args.gap_ms / 1e3
            )
        )
    finally:
        for b in backends:
            b.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"loop wall time per request (client + sidecar, unprofiled): {wall * 1e6:.1f} us")
    print(hops.summary(", back to back"))
    if cold is not None:
        print(cold.summary(f", {args.gap_ms:g} ms idle before each"))
    if args.out:
        prof.dump_stats(args.out)
    stats = pstats.Stats(prof)
    stats.sort_stats(args.sort).print_stats(args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
