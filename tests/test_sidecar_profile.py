"""The hop timer of loadtest/sidecar_profile.py: each request's two sidecar hops from the
first mark of each probe, a request missing a probe left out (the run itself starts
backends and a sidecar; the timer is what decides the printed figures)."""

from __future__ import annotations

from loadtest.sidecar_profile import _Hops


def test_each_request_gives_its_two_hops_from_the_first_marks() -> None:
    hops = _Hops()
    us = 1000
    hops.marks += [
        (0, "srv_recv"),
        (150 * us, "up_send"),
        (400 * us, "up_recv"),
        (420 * us, "up_recv"),  # a later read of the same answer: not the hop's start
        (450 * us, "srv_write"),
        (460 * us, "srv_write"),
    ]
    hops.request_done()
    assert (hops.pre, hops.post) == ([150.0], [50.0]) and hops.marks == []
    hops.marks += [(0, "srv_recv"), (10 * us, "srv_write")]  # refused before any upstream
    hops.request_done()
    assert (hops.pre, hops.post) == ([150.0], [50.0])
    assert "srv_recv->up_send p50 150.0 us" in hops.summary()
    assert "up_recv->srv_write p50 50.0 us" in hops.summary()
