"""The ports handed to real vLLM processes (loadtest/real_vllm.py): free when handed out,
never twice, and outside the kernel's ephemeral range, so that no socket bound to port 0
or connecting out takes one before vLLM binds it."""

from __future__ import annotations

import socket
from pathlib import Path

from loadtest import real_vllm


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low = real_vllm.ephemeral_low()
    ports = [real_vllm.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free: nothing here holds it


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaults(tmp_path: Path) -> None:
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t60999\n")
    assert real_vllm.ephemeral_low(f) == 40000
    assert real_vllm.ephemeral_low(tmp_path / "missing") == 32768
    f.write_text("")
    assert real_vllm.ephemeral_low(f) == 32768
