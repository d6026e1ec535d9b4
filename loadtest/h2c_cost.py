"""What h2c (HTTP/2 cleartext) from clients would cost the sidecar per request, against the
HTTP/1.1 framing it does now: the server side of one exchange (a POST completion request,
a one-event streamed answer) through the `h2` library's state machine, vs httptools' parse
and our chunked framing of the same exchange. Protocol work only, no sockets, in one run.

Run: `python -m loadtest.h2c_cost [--requests 2000]` (needs the `bench` extra, for h2).

Measured 2026-12-06 (2 shared vCPUs): h2 ~96-108 us a request, HTTP/1.1 ~1 us: ~100x, and
~100 us is about a third of everything the sidecar does for a request
(`loadtest.sidecar_instructions`). On a sidecar's loopback hop with keep-alive connections
HTTP/2 saves no handshake and no head-of-line blocking worth that, so the listener speaks
HTTP/1.1 only (issue #22 asked to say why not).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import httptools

_BODY = json.dumps(
    {"model": "stub-model", "prompt": "hello world " * 20, "max_tokens": 1, "stream": True}
).encode()
_SSE = b'data: {"id":"x","choices":[{"text":" the","index":0}]}\n\ndata: [DONE]\n\n'


def h2_per_request(n: int) -> float:
    """Seconds of the server side's h2 work per exchange (the client's is not counted)."""
    import h2.config
    import h2.connection
    import h2.events

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    headers = [
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":scheme", "http"),
        (":authority", "x"),
        ("content-type", "application/json"),
        ("content-length", str(len(_BODY))),
    ]
    spent = 0.0
    for _ in range(n):
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, headers)
        client.send_data(sid, _BODY, end_stream=True)
        data = client.data_to_send()
        t = time.perf_counter()
        for ev in server.receive_data(data):
            if isinstance(ev, h2.events.DataReceived):
                server.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                server.send_headers(
                    ev.stream_id, [(":status", "200"), ("content-type", "text/event-stream")]
                )
                server.send_data(ev.stream_id, _SSE, end_stream=True)
        out = server.data_to_send()
        spent += time.perf_counter() - t
        for ev in client.receive_data(out):
            if isinstance(ev, h2.events.DataReceived):
                client.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        server.receive_data(client.data_to_send())
        server.data_to_send()
    return spent / n


class _Sink:
    def on_url(self, url: bytes) -> None:
        pass

    def on_header(self, name: bytes, value: bytes) -> None:
        pass

    def on_body(self, body: bytes) -> None:
        pass


def http11_per_request(n: int) -> float:
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(_BODY), _BODY)
    )
    parser = httptools.HttpRequestParser(_Sink())
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    t = time.perf_counter()
    for _ in range(n):
        parser.feed_data(raw)
        _ = head + b"%x\r\n%b\r\n" % (len(_SSE), _SSE) + b"0\r\n\r\n"
    return (time.perf_counter() - t) / n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.h2c_cost", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args(argv)
    try:
        h2_s = h2_per_request(args.requests)
    except ImportError:
        print("needs h2: pip install -e '.[bench]'", file=sys.stderr)
        return 1
    h1_s = http11_per_request(args.requests)
    print(f"server-side protocol work per request ({args.requests} requests, one connection)")
    print(f"  h2 (h2 library)                 {h2_s * 1e6:8.1f} us")
    print(f"  HTTP/1.1 (httptools + framing)  {h1_s * 1e6:8.1f} us")
    print(f"  h2 / HTTP/1.1                   {h2_s / h1_s:8.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
