"""The fault campaign (loadtest/chaos.py) at its smallest: two scenarios on real processes
(simulated engines, meshd sidecar) must lose no request and keep a 503 storm's retries in
bound; its parts (limit probes at exact sizes, goodput, overrides, the CLI, the latency
scenario's delay proxy) on their own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest import chaos
from loadtest.bench.fleet import sim_unavailable
from loadtest.chaos import QUICK, Row, campaign, table
from loadtest.chaos_client import Outcome, limit_probes
from loadtest.chaos_delay import MAX_HELD_CHUNKS, DelayProxy
from loadtest.chaos_scenarios import scenarios


@pytest.mark.skipif(sim_unavailable() is not None, reason=str(sim_unavailable()))
async def test_engine_faults_lose_nothing_and_a_storm_stays_in_bound(tmp_path: Path) -> None:
    rows = await campaign(["engine-reset", "all-503"], QUICK, tmp_path, True, False)
    by = {r.scenario: r for r in rows}
    for r in rows:
        assert r.skipped is None and r.sent > 0, r
        assert r.lost == 0 and r.broken == 0 and r.outlived == 0, r
        assert r.checks == [], r
    reset = by["engine-reset"]
    # every stream the engine reset went on elsewhere: the clients saw none of it
    assert reset.completed == reset.sent and reset.resumed > 0
    storm = by["all-503"]
    assert storm.failed > 0 and all(k.startswith(("HTTP 503", "HTTP 502")) for k in storm.failures)
    assert storm.amplification is not None and storm.amplification <= 1.2
    assert storm.fault_amplification is not None and storm.fault_amplification <= 1.2
    assert (tmp_path / "all-503" / "requests.jsonl").read_text().count("\n") == storm.sent
    assert "| engine-reset |" in table(rows)


def _head(raw: bytes) -> tuple[list[tuple[str, str]], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")[1:]
    return [(k, v.lstrip()) for k, _, v in (ln.partition(":") for ln in lines)], body


def test_limit_probes_sit_exactly_at_and_one_past_each_limit() -> None:
    probes = {p["name"]: p["raw"] for p in limit_probes(65536, 100, 16384)}
    assert len(_head(probes["body at limit"])[1]) == 65536
    assert len(_head(probes["body over"])[1]) == 65537
    assert len(_head(probes["headers at count"])[0]) == 100
    assert len(_head(probes["headers over count"])[0]) == 101
    size = [
        sum(len(k) + len(v) for k, v in _head(probes[n])[0])
        for n in ("header bytes at", "header bytes over")
    ]
    assert size == [16384, 16385]  # names + values, as meshd/listener.py counts them
    assert json.loads(_head(probes["body at limit"])[1])["max_tokens"] == 1


def _outcome(sent: float, ended: float, kind: Any = "completed") -> Outcome:
    return Outcome(sent, ended, kind, 200, "", 10)


def test_goodput_spreads_each_completion_over_its_life() -> None:
    outs = [_outcome(0.0, 4.0), _outcome(2.0, 4.0), _outcome(1.0, 3.0, "failed")]
    # [2, 4]: half of the first, all of the second; the failure counts for nothing
    assert chaos._goodput(outs, 2.0, 4.0) == pytest.approx(1.5 / 2.0)


def test_overrides_merge_dotted_keys_with_json_values() -> None:
    got = chaos._overrides(
        ["reliability.breaker.enabled=false", "reliability.retry.ratio=0.1", "log_level=debug"],
        {"reliability": {"outlier": {"enabled": False}}},
    )
    assert got == {
        "reliability": {
            "outlier": {"enabled": False},
            "breaker": {"enabled": False},
            "retry": {"ratio": 0.1},
        },
        "log_level": "debug",
    }


def test_cli_names_unknown_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        chaos.main(["--scenarios", "baseline,meteor-strike"])
    assert exc.value.code == 2 and "meteor-strike" in capsys.readouterr().err


def test_cli_writes_the_rows_and_fails_on_a_missed_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def fake(names: Any, s: Any, workdir: Path, quiet: bool, in_netns: bool) -> list[Row]:
        return [
            Row("baseline", "no fault", sent=3, completed=3, amplification=1.0, outlived=0),
            Row("partition", "iptables", skipped="needs the `iptables` command"),
            Row("all-503", "storm", sent=2, failed=2, checks=["amplification 1.5 > 1.2"]),
        ]

    monkeypatch.setattr(chaos, "campaign", fake)
    out = tmp_path / "chaos.json"
    code = chaos.main(["--scenarios", "baseline,partition,all-503", "--json", str(out), "--quiet"])
    doc = json.loads(out.read_text())
    assert code == 1
    assert {"date", "machine", "settings", "rows"} <= doc.keys()
    assert [r["scenario"] for r in doc["rows"]] == ["baseline", "partition", "all-503"]
    assert doc["rows"][1]["skipped"] == "needs the `iptables` command"
    text = table([Row(**r) for r in doc["rows"]])
    assert "| partition | skipped: needs the `iptables` command |" in text


# ---- the latency scenario's delay proxy -----------------------------------------------

Ends = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@contextlib.asynccontextmanager
async def _through_proxy(
    max_held_chunks: int = MAX_HELD_CHUNKS,
) -> AsyncIterator[tuple[DelayProxy, Ends, Ends]]:
    """A DelayProxy in front of a server that hands over its end of the connection: the
    proxy, the client's end and the server's."""
    accepted: asyncio.Queue[Ends] = asyncio.Queue()
    server = await asyncio.start_server(lambda r, w: accepted.put_nowait((r, w)), "127.0.0.1", 0)
    proxy = DelayProxy("127.0.0.1", server.sockets[0].getsockname()[1], max_held_chunks)
    await proxy.start()
    client = await asyncio.open_connection("127.0.0.1", proxy.port)
    upstream = await asyncio.wait_for(accepted.get(), 5)
    try:
        yield proxy, client, upstream
    finally:
        for _, w in (client, upstream):
            w.transport.abort()
        await proxy.close()
        server.close()


@settings(max_examples=25, deadline=None)
@given(
    up=st.lists(st.binary(min_size=1, max_size=2048), max_size=8),
    down=st.lists(st.binary(min_size=1, max_size=2048), max_size=8),
    delays_ms=st.lists(st.sampled_from([0, 5, 10]), min_size=1, max_size=8),
    held=st.integers(1, 3),
)
def test_the_delay_proxy_forwards_every_byte_in_order(
    up: list[bytes], down: list[bytes], delays_ms: list[int], held: int
) -> None:
    """Whatever the chunking, however few chunks it may hold, and with the delay changed
    (also cut) between chunks, so that a later chunk is due before an earlier one."""

    async def go() -> tuple[bytes, bytes]:
        async with _through_proxy(held) as (proxy, (r, w), (ur, uw)):
            for i, chunk in enumerate(up):
                proxy.delay(down_ms=0, up_ms=delays_ms[i % len(delays_ms)])
                w.write(chunk)
                await w.drain()
                await asyncio.sleep(0.001)  # so that the proxy reads it as a chunk of its own
            for i, chunk in enumerate(down):
                proxy.delay(down_ms=delays_ms[-1 - i % len(delays_ms)])
                uw.write(chunk)
                await uw.drain()
                await asyncio.sleep(0.001)
            got_up = await asyncio.wait_for(ur.readexactly(sum(map(len, up))), 5)
            uw.write_eof()
            return got_up, await asyncio.wait_for(r.read(), 5)  # to the end

    got_up, got_down = asyncio.run(go())
    assert got_up == b"".join(up)
    assert got_down == b"".join(down)


async def test_a_delay_adds_its_ms_to_each_direction_it_delays_and_none_when_off() -> None:
    async with _through_proxy() as (proxy, (r, w), (ur, uw)):
        loop = asyncio.get_running_loop()

        async def trip() -> tuple[float, float]:
            t0 = loop.time()
            w.write(b"ping")
            await ur.readexactly(4)
            t1 = loop.time()
            uw.write(b"pong")
            await r.readexactly(4)
            return t1 - t0, loop.time() - t1

        proxy.delay(down_ms=100, up_ms=50)
        up_s, down_s = await trip()
        assert up_s >= 0.05 and down_s >= 0.1
        proxy.delay(down_ms=50)  # the latency scenario's: what the engine sends
        up_s, down_s = await trip()
        assert up_s < 0.05 <= down_s
        proxy.delay(down_ms=0)
        up_s, down_s = await trip()
        assert up_s < 0.05 and down_s < 0.05


async def test_the_delay_is_a_line_not_a_queue_each_chunk_waits_only_its_own() -> None:
    """Five chunks 10 ms apart through a 60 ms line arrive ~100 ms after the first was sent,
    not 5 x 60 ms (a chunk held behind the previous one's sleep would cut throughput)."""
    async with _through_proxy() as (proxy, (r, _), (_, uw)):
        loop = asyncio.get_running_loop()
        proxy.delay(down_ms=60)
        t0 = loop.time()
        for i in range(5):
            uw.write(b"%d" % i)
            await asyncio.sleep(0.01)
        assert await asyncio.wait_for(r.readexactly(5), 5) == b"01234"
        assert 0.06 <= loop.time() - t0 < 0.2


@pytest.mark.parametrize("closing", ["client", "upstream"])
async def test_either_side_ending_ends_both_after_the_bytes_before_it(closing: str) -> None:
    async with _through_proxy() as (proxy, client, upstream):
        proxy.delay(down_ms=20, up_ms=20)
        (_, w), (r, _) = (client, upstream) if closing == "client" else (upstream, client)
        w.write(b"last words")
        w.write_eof()
        assert await asyncio.wait_for(r.read(), 5) == b"last words"
        # and the closing side's own reader sees the proxy close it
        ending_reader = (client if closing == "client" else upstream)[0]
        assert await asyncio.wait_for(ending_reader.read(), 5) == b""


async def test_a_reset_travels_through_and_a_closed_proxy_resets_its_connections() -> None:
    async with _through_proxy() as (proxy, (r, _), (_, uw)):
        proxy.delay(down_ms=20)
        uw.write(b"half a stream")
        sock = uw.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        uw.transport.abort()  # a reset (RST), not a FIN
        assert await asyncio.wait_for(r.readexactly(13), 5) == b"half a stream"
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(r.read(), 5)
    async with _through_proxy() as (proxy, (r, _w), _):
        await proxy.close()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(r.read(), 5)


async def test_the_delay_proxy_resets_a_client_when_the_upstream_refuses() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    proxy = DelayProxy("127.0.0.1", port)
    await proxy.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(r.read(), 5)
        w.close()
    finally:
        await proxy.close()


def test_only_the_latency_scenario_puts_delay_proxies_in_the_path() -> None:
    with_proxies = [
        sc.name for sc in scenarios(QUICK) if sc.rig is not None and sc.rig(QUICK).delay_proxies
    ]
    assert with_proxies == ["latency"]
