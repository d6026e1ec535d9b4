"""loadtest/real_vllm.py's process housekeeping: the ports handed to vLLM processes are
free when handed out, never twice, and outside the kernel's ephemeral range (no socket
bound to port 0 or connecting out takes one before vLLM binds it); stopping an instance
leaves none of its processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
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


def test_stop_leaves_none_of_the_instances_processes(tmp_path: Path) -> None:
    # A parent that SIGTERM ends at once and a child that outlives it, as a vLLM API server
    # whose engine failed while starting leaves its worker.
    pid_file = tmp_path / "child"
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    inst = real_vllm.VllmInstance("t", 1, 2, 3, "sha256", None, proc, tmp_path / "log")
    inst.stop(timeout_s=5)
    assert proc.poll() is not None
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists():
        status = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if status == "Z":
            break  # killed, not yet reaped by its new parent
        assert time.monotonic() < deadline, "the child outlived stop()"
        time.sleep(0.05)
