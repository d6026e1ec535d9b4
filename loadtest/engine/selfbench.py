"""How much load the engine simulator itself carries: streams, tokens/s, CPU per token.

Starts a fleet in a child process (`python -m loadtest.engine.cli`), drives it from this
process with `streams` concurrent streaming completions per engine (each restarting as
soon as it ends), and reports the child's CPU time per generated token and how well the
simulated GPUs kept pace (busy time / elapsed simulated time; below 1 the host, not the
model, limited the rate)::

    python -m loadtest.engine.selfbench --engines 16 --streams 32 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass

import aiohttp

GPUS = "H100,A100,H200,B200"


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


@dataclass
class Result:
    engines: int
    streams_per_engine: int
    time_scale: float
    seconds: float
    tokens: int
    requests: int
    sim_cpu_s: float
    sim_sys_s: float
    client_cpu_s: float
    utilisation_min: float
    utilisation_mean: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_us_per_token(self) -> float:
        return 1e6 * self.sim_cpu_s / max(1, self.tokens)

    def line(self) -> str:
        return (
            f"engines={self.engines} streams/engine={self.streams_per_engine} "
            f"time_scale={self.time_scale:g} tokens/s={self.tokens_per_s:,.0f} "
            f"req/s={self.requests / self.seconds:,.1f} "
            f"sim_cpu={100 * self.sim_cpu_s / self.seconds:.0f}% "
            f"(sys {100 * self.sim_sys_s / self.seconds:.0f}%) "
            f"cpu/token={self.cpu_us_per_token:.1f}us "
            f"client_cpu={100 * self.client_cpu_s / self.seconds:.0f}% "
            f"gpu_pace min/mean={self.utilisation_min:.2f}/{self.utilisation_mean:.2f}"
        )


async def _stream_forever(
    session: aiohttp.ClientSession, url: str, body: bytes, stop: asyncio.Event, counts: list[int]
) -> None:
    while not stop.is_set():
        try:
            async with session.post(
                url + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        counts[0] += 1
            counts[1] += 1
        except aiohttp.ClientError:
            await asyncio.sleep(0.01)


async def _pace(session: aiohttp.ClientSession, urls: list[str]) -> list[tuple[float, float]]:
    out = []
    for u in urls:
        async with session.get(u + "/admin/state") as r:
            st = await r.json()
        out.append((st["busy_time"], st["sim_time"]))
    return out


async def run_bench(
    engines: int,
    streams: int,
    seconds: float,
    time_scale: float,
    max_tokens: int,
    prompt_words: int,
) -> Result:
    cmd = [
        sys.executable,
        "-m",
        "loadtest.engine.cli",
        "--port",
        "0",
        "--fleet",
        str(engines),
        "--gpus",
        GPUS,
        "--time-scale",
        str(time_scale),
    ]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        urls = []
        for _ in range(engines):
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            urls.append(line.split("url=")[1].split()[0])
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            stop = asyncio.Event()
            counts = [0, 0]
            tasks = []
            for e, url in enumerate(urls):
                for s in range(streams):
                    prompt = " ".join(f"e{e}s{s}w{i}" for i in range(prompt_words))
                    body = json.dumps(
                        {
                            "prompt": prompt,
                            "max_tokens": max_tokens,
                            "stream": True,
                            "ignore_eos": True,
                        }
                    ).encode()
                    tasks.append(
                        asyncio.create_task(_stream_forever(session, url, body, stop, counts))
                    )
            await asyncio.sleep(min(2.0, seconds / 4))  # warm-up: streams reach steady state
            pace0 = await _pace(session, urls)
            tok0, req0, t0 = counts[0], counts[1], time.perf_counter()
            cpu0, me0 = _cpu_seconds(proc.pid), time.process_time()
            await asyncio.sleep(seconds)
            tok1, req1, t1 = counts[0], counts[1], time.perf_counter()
            cpu1, me1 = _cpu_seconds(proc.pid), time.process_time()
            pace1 = await _pace(session, urls)
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        util = [(b1 - b0) / (s1 - s0) for (b0, s0), (b1, s1) in zip(pace0, pace1, strict=True)]
        return Result(
            engines,
            streams,
            time_scale,
            t1 - t0,
            tok1 - tok0,
            req1 - req0,
            sum(cpu1) - sum(cpu0),
            cpu1[1] - cpu0[1],
            me1 - me0,
            min(util),
            sum(util) / len(util),
        )
    finally:
        proc.terminate()
        await proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", type=int, default=16)
    p.add_argument("--streams", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--time-scale", type=float, nargs="+", default=[1.0])
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--prompt-words", type=int, default=100)
    args = p.parse_args(argv)
    for scale in args.time_scale:
        for streams in args.streams:
            r = asyncio.run(
                run_bench(
                    args.engines, streams, args.seconds, scale, args.max_tokens, args.prompt_words
                )
            )
            print(r.line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
