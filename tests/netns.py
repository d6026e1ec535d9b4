"""Network namespaces for tests, and the tiny programs run inside them.

As a library: `NetnsPair` builds two namespaces joined by a veth pair (test-only addresses,
everything removed on close) and `Process` starts a program that announces readiness with
one JSON line. As a script (`python tests/netns.py ROLE ...`): the backends and unmodified
clients that tests/test_netns_interception.py runs with `ip netns exec`.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import os
import selectors
import shutil
import signal
import socket
import socketserver
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

READY_TIMEOUT_S = 15.0
# Commands run from the checkout so `python -m meshd.cli` finds this tree's meshd.
REPO = Path(__file__).resolve().parent.parent


def missing_prerequisites() -> str | None:
    """Why a namespace test cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces and install iptables rules"
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (Debian package {package})"
    return None


def run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        list(argv), capture_output=True, text=True, check=False, timeout=30, cwd=REPO
    )
    if check and done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout}"
        )
    return done


@dataclass
class NetnsPair:
    """Namespaces `client` and `server` joined by veth0 (client) <-> veth1 (server).

    The veth pair is created inside the namespaces, so deleting them removes it too;
    nothing is left in the host's own namespace even if a test dies half-way.
    """

    client_ip: str = "10.231.0.1"
    server_ip: str = "10.231.0.2"
    prefix_len: int = 30
    tag: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:6]}")
    created: list[str] = field(default_factory=list)

    @property
    def client(self) -> str:
        return f"meshd-test-{self.tag}-c"

    @property
    def server(self) -> str:
        return f"meshd-test-{self.tag}-s"

    def create(self) -> NetnsPair:
        try:
            for ns in (self.client, self.server):
                run(["ip", "netns", "add", ns])
                self.created.append(ns)
                run(["ip", "-n", ns, "link", "set", "lo", "up"])
            run(["ip", "-n", self.client, "link", "add", "veth0", "type", "veth",
                 "peer", "name", "veth1", "netns", self.server])  # fmt: skip
            for ns, dev, ip in ((self.client, "veth0", self.client_ip),
                                (self.server, "veth1", self.server_ip)):  # fmt: skip
                run(["ip", "-n", ns, "addr", "add", f"{ip}/{self.prefix_len}", "dev", dev])
                run(["ip", "-n", ns, "link", "set", dev, "up"])
        except BaseException:
            self.close()
            raise
        return self

    def exec_argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        for ns in reversed(self.created):
            run(["ip", "netns", "del", ns], check=False)
        self.created.clear()

    def __enter__(self) -> NetnsPair:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()


class Process:
    """A child that prints one JSON line {"event": "ready", ...} when it is ready."""

    def __init__(self, argv: Sequence[str], *, stderr_path: Path, env: dict[str, str]) -> None:
        self.argv = list(argv)
        self.stderr_path = stderr_path
        self._stderr: BinaryIO = open(stderr_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        self.ready: dict[str, Any] = {}

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self.argv} not ready in {timeout_s}s: {self.stderr()}")
                if not sel.select(remaining):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    self.proc.wait(5)
                    raise RuntimeError(
                        f"{self.argv} exited ({self.proc.returncode}) before ready: {self.stderr()}"
                    )
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    with contextlib.suppress(ValueError):
                        event = json.loads(line)
                        if isinstance(event, dict) and event.get("event") == "ready":
                            self.ready = event
                            return event

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


# ---------------------------------------------------------------- programs (script mode)


def _announce(**fields: Any) -> None:
    print(json.dumps({"event": "ready", **fields}), flush=True)


def serve_http_backend(host: str, port: int, log_path: str) -> None:
    """An OpenAI-shaped engine that logs every request (path, via, peer) before answering."""
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _record(self, body: bytes) -> None:
            entry = {
                "method": self.command,
                "path": self.path,
                "via": self.headers.get_all("via") or [],
                "peer": list(self.client_address),
                "body": body.decode(errors="replace"),
            }
            with lock, open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")

        def _reply(self, doc: dict[str, Any]) -> None:
            data = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            self._record(body)
            model = json.loads(body or b"{}").get("model", "tiny")
            self._reply(
                {
                    "id": "chatcmpl-netns",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "hello from the engine"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
                }
            )

        def do_GET(self) -> None:
            self._record(b"")
            self._reply({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    _announce(port=server.server_address[1])
    server.serve_forever()


def serve_echo(host: str, port: int) -> None:
    """Says who connected, echoes every byte, and after the client's EOF sends a trailer."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock: socket.socket = self.request
            peer = sock.getpeername()
            sock.sendall(f"peer={peer[0]}:{peer[1]}\n".encode())
            while chunk := sock.recv(65536):
                sock.sendall(chunk)
            sock.sendall(b"<after-eof>")

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    server = socketserver.ThreadingTCPServer((host, port), Handler)
    _announce(port=server.server_address[1])
    server.serve_forever()


def http_client(host: str, port: int, path: str, body: str) -> None:
    """An unmodified app: plain http.client to the engine's own address."""
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.connect()
    local_port = conn.sock.getsockname()[1]
    conn.request("POST", path, body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    print(json.dumps({"status": resp.status, "body": data.decode(), "local_port": local_port}))


def tcp_client(host: str, port: int, size: int) -> None:
    """Sends `size` bytes of every byte value, half-closes, and checks what comes back."""
    payload = bytes(range(256)) * (size // 256)
    sock = socket.create_connection((host, port), timeout=10)
    local_port = sock.getsockname()[1]
    received = bytearray()

    def reader() -> None:
        while chunk := sock.recv(65536):
            received.extend(chunk)

    t = threading.Thread(target=reader)
    t.start()
    sock.sendall(payload)
    sock.shutdown(socket.SHUT_WR)
    t.join(10)
    sock.close()
    header, _, rest = bytes(received).partition(b"\n")
    print(
        json.dumps(
            {
                "local_port": local_port,
                "peer": header.decode(errors="replace"),
                "echoed": rest[: len(payload)] == payload,
                "trailer": rest[len(payload) :].decode(errors="replace"),
            }
        )
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)
    p = sub.add_parser("http-backend")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log", required=True)
    p = sub.add_parser("echo")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p = sub.add_parser("http-client")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", default="/v1/chat/completions")
    p.add_argument("--body", required=True)
    p = sub.add_parser("tcp-client")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--size", type=int, default=1 << 20)
    args = parser.parse_args(argv)
    if args.role == "http-backend":
        serve_http_backend(args.host, args.port, args.log)
    elif args.role == "echo":
        serve_echo(args.host, args.port)
    elif args.role == "http-client":
        http_client(args.host, args.port, args.path, args.body)
    else:
        tcp_client(args.host, args.port, args.size)


if __name__ == "__main__":
    main()
