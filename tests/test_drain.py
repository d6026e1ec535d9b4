"""SIGTERM drains a real `meshd sidecar` process: no new connections, running
streams finish, exit status 0."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiohttp
import pytest
from backends import sse_events


async def test_sigterm_lets_running_streams_finish_then_exits_zero(backends, tmp_path):
    b = await backends()
    cfg = tmp_path / "meshd.yaml"
    cfg.write_text(
        "listeners: {outbound: {port: 0}, admin: {port: 0}}\n"
        f"pools: [{{name: default, endpoints: ['{b.url}']}}]\n"
        "drain: {grace_period_s: 10}\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "meshd.cli",
        "sidecar",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert ready["event"] == "ready"
        base = f"http://{ready['outbound']}"
        async with aiohttp.ClientSession() as http:
            req = {"model": "tiny", "prompt": "stall", "max_tokens": 3, "stream": True}
            resp = await http.post(base + "/v1/completions", json=req)
            assert (await resp.content.readany()).startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)
            draining = json.loads(await asyncio.wait_for(proc.stdout.readline(), 10))
            assert draining == {"event": "draining", "active": 1}
            # The listener is closed: a new connection is refused while the stream runs.
            async with aiohttp.ClientSession() as other:
                with pytest.raises(aiohttp.ClientConnectionError):
                    await other.get(base + "/v1/models")
            b.release.set()
            events = sse_events(await asyncio.wait_for(resp.read(), 10))
        assert events[-1] == "[DONE]"
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
