"""Where the sidecar's per-request work goes, function by function: the sidecar runs in this
process (uvloop) in front of stub backends (their own processes), the load generator sends
N one-at-a-time streamed completions through it, and cProfile records only those N. The
load generator's own functions (loadtest/openloop.py) are in the profile too; read the
sidecar's (meshd/, filters/) beside them.

Run: `python -m loadtest.sidecar_profile [--requests 2000] [--tokens 1] [--sort tottime]
[--out FILE.prof]`. Also prints the wall time per request of the whole loop (client
included) without the profiler, which moves with per-request work on a quiet machine.
`--set routing.policy=round-robin` runs a sidecar config key as sidecar_instructions does.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from loadtest.openloop import Endpoint, LoadGenerator, completion_request
from loadtest.overhead import Child, meshd_config, process_settings, start_backends


async def _drive(
    config_tree: dict[str, object], eps: Sequence[Endpoint], tokens: int, n: int, warmup: int
) -> tuple[cProfile.Profile, float]:
    from meshd.config import load_config
    from meshd.sidecar import Sidecar

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
        prof.enable()
        for _ in range(n):
            await gen.one()
        prof.disable()
    finally:
        await gen.close()
        await sidecar.drain_and_stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return prof, wall


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.sidecar_profile", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=200)
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
        prof, wall = uvloop.run(_drive(tree, eps, args.tokens, args.requests, args.warmup))
    finally:
        for b in backends:
            b.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"loop wall time per request (client + sidecar, unprofiled): {wall * 1e6:.1f} us")
    if args.out:
        prof.dump_stats(args.out)
    stats = pstats.Stats(prof)
    stats.sort_stats(args.sort).print_stats(args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
