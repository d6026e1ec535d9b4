"""loadtest/ttfb_hops.py: the hop reader on made-up events, and one short real run whose
probes must still find the aiohttp and meshd functions they wrap (private names that move
between versions: a probe that no longer fires shows up here as a missing hop)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.ttfb_hops import DIRECT, PROXIED, Event, follow, format_hops, measure, read_events


def _events(spec: list[tuple[int, str, str, int]]) -> list[Event]:
    return [Event(t, p, tag, cpu) for t, p, tag, cpu in spec]


def test_each_send_opens_a_window_and_the_first_event_of_each_hop_counts() -> None:
    events = _events(
        [
            (1_000, "client", "cl_send", 0),
            (1_100, "backend", "srv_recv", 0),
            (1_150, "backend", "srv_recv", 1),  # a second read of the same request
            (1_400, "backend", "srv_write", 0),
            (1_500, "backend", "srv_write", 0),
            (1_700, "client", "cl_recv", 0),
            (1_900, "client", "cl_recv", 0),
            (5_000, "client", "cl_send", 1),
            (5_300, "backend", "srv_recv", 0),
            (5_600, "backend", "srv_write", 0),
            (6_100, "client", "cl_recv", 1),
        ]
    )
    hops = follow(events, DIRECT)
    assert hops.times_ns == [[1_000, 1_100, 1_400, 1_700], [5_000, 5_300, 5_600, 6_100]]
    assert hops.gaps_us(0) == [0.1, 0.3]
    assert hops.total_us() == [0.7, 1.1]
    assert hops.one_cpu_share() == 0.5  # the second request's hops ran on CPUs 0 and 1
    text = format_hops("direct", hops)
    assert "2 requests" in text and "50% of requests" in text


def test_a_window_missing_a_hop_is_left_out_not_borrowed_from_the_next() -> None:
    events = _events(
        [
            (1_000, "client", "cl_send", 0),
            (1_100, "backend", "srv_recv", 0),  # no write before the next send
            (2_000, "client", "cl_send", 0),
            (2_100, "backend", "srv_recv", 0),
            (2_200, "backend", "srv_write", 0),
            (2_300, "client", "cl_recv", 0),
        ]
    )
    assert follow(events, DIRECT).times_ns == [[2_000, 2_100, 2_200, 2_300]]


def test_hops_must_come_in_chain_order() -> None:
    events = _events(
        [
            (1_000, "client", "cl_send", 0),
            (1_050, "sidecar", "up_send", 0),  # before the sidecar read the request
            (1_100, "sidecar", "srv_recv", 0),
            (1_200, "backend", "srv_recv", 0),
            (1_300, "backend", "srv_write", 0),
            (1_400, "sidecar", "up_recv", 0),
            (1_500, "sidecar", "srv_write", 0),
            (1_600, "client", "cl_recv", 0),
        ]
    )
    assert follow(events, PROXIED).times_ns == []


def test_read_events_names_processes_and_drops_the_warm_up(tmp_path: Path) -> None:
    (tmp_path / "10.log").write_text("100 cl_send 0\n300 cl_recv 1\n")
    (tmp_path / "20.log").write_text("50 srv_recv 1\n200 srv_recv 0\n")
    (tmp_path / "30.log").write_text("250 up_recv 1\n")
    got = read_events(tmp_path, {10: "client", 30: "sidecar"}, since_ns=100)
    assert got == [
        Event(100, "client", "cl_send", 0),
        Event(200, "backend", "srv_recv", 0),
        Event(250, "sidecar", "up_recv", 1),
        Event(300, "client", "cl_recv", 1),
    ]


@pytest.mark.parametrize("target", ["meshd", "direct"])
def test_a_real_run_sees_every_hop_of_most_requests(target: str) -> None:
    hops = measure(target, rate=40.0, duration_s=1.0, placement="shared", tokens=20, backends=1)
    # ~40 Poisson arrivals; a request overlapping the next one's send is left out.
    assert len(hops.times_ns) >= 15
    for i in range(len(hops.chain) - 1):
        assert all(g >= 0 for g in hops.gaps_us(i))
    assert 0 < hops.total_us()[len(hops.times_ns) // 2] < 100_000


def test_a_run_leaves_this_process_as_it_found_it() -> None:
    import asyncio
    import os

    from loadtest import openloop

    send, received = openloop._Connection.send, openloop._Connection.data_received
    policy = type(asyncio.get_event_loop_policy())
    env = {k: os.environ.get(k) for k in ("PYTHONPATH", "MESHD_HOPS_DIR")}
    cpus = os.sched_getaffinity(0)
    measure("direct", rate=40.0, duration_s=0.3, placement="shared", tokens=5, backends=1)
    assert openloop._Connection.send is send
    assert openloop._Connection.data_received is received
    assert type(asyncio.get_event_loop_policy()) is policy  # uvloop for the run only
    assert {k: os.environ.get(k) for k in env} == env
    assert os.sched_getaffinity(0) == cpus
