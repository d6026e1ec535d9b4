"""The control plane's ingest alone: CPU per published update, by transport and by how
many updates one publish message carries. A real control plane (xds/server.py, its own
process, no subscribers, EDS view on) and real publishers (xds/client.py over gRPC,
xds/publish_frames.py over the frames port); the figure is the control-plane process's CPU
seconds (/proc) over the updates it ingested, with the in-process cost of
`ControlPlane.publish()` alone (decode, validate, cache, version, EDS hint; no transport)
measured in the same run, so the transport's share shows. `--tls`: both ports with mTLS
(a CA, server and client certificates made for the run).

Run: `python -m loadtest.xds_ingest_bench [--transports grpc,frames] [--batches 1,10,50]
[--updates 20000] [--streams 8] [--tls] [--json PATH]`. JSON keys: publish_call_us,
us_per_update[transport][batch] (and grpc_us_per_update[batch], the gRPC row).

Measured 2026-12-06 on 2 shared vCPUs (issue #23): `publish()` alone ~7-11 us an update;
over gRPC ~148 us an update one per message, ~26 us ten per message, ~13 us fifty per
message. grpc.aio's read of one stream message costs ~115 us of Python in the control plane
even when it sends no reply, so the <= 50 us target needs several updates per message (an
agent that publishes for the engines of its node) or a cheaper transport.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from loadtest.procstats import cpu_seconds
from loadtest.xds_scale_bench import engine_body
from xds.resources import ENDPOINT_STATE_TYPE

ENGINES = 1000


def _control_plane(conn: Connection, pems: dict[str, bytes] | None) -> None:
    from xds.server import ControlPlane, TlsConfig

    async def main() -> None:
        cp = ControlPlane()
        tls = None if pems is None else TlsConfig(pems["server"], pems["server_key"], pems["ca"])
        port = await cp.start("127.0.0.1", 0, tls, publish_port=0)
        conn.send((port, cp.publish_port))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        conn.send(cp.stats.publishes)
        await cp.stop(0)

    asyncio.run(main())


def _certificates(tmp: Path) -> dict[str, bytes]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (PEM), the
    client's also written to `tmp` (the ssl module loads a key pair from files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(name: str, key: Any, issuer: Any, signer: Any, ca: bool) -> Any:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if ca:
            b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        else:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
            b = b.add_extension(san, critical=False)
        return b.sign(signer, hashes.SHA256())

    def pem_key(key: Any) -> bytes:
        return bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench-ca")])
    ca = cert("bench-ca", ca_key, ca_name, ca_key, True)
    out = {"ca": ca.public_bytes(serialization.Encoding.PEM)}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[name] = cert(name, key, ca.subject, ca_key, False).public_bytes(
            serialization.Encoding.PEM
        )
        out[f"{name}_key"] = pem_key(key)
    for name, body in out.items():
        (tmp / f"{name}.pem").write_bytes(body)
    return out


def _name(i: int) -> str:
    return f"engine-{i % ENGINES:05d}"


async def _over(
    transport: str,
    ports: tuple[int, int],
    pid: int,
    batch: int,
    updates: int,
    streams: int,
    tls: Path | None,
) -> float:
    """Control-plane CPU seconds per update, `batch` updates a message."""
    from xds.client import Publisher, tls_client_context
    from xds.publish_frames import FramePublisher

    pubs: list[Publisher | FramePublisher]
    if transport == "grpc":
        creds = None
        if tls is not None:
            creds = grpc.ssl_channel_credentials(
                *((tls / f"{n}.pem").read_bytes() for n in ("ca", "client_key", "client"))
            )
        pubs = [Publisher(f"127.0.0.1:{ports[0]}", credentials=creds) for _ in range(streams)]
    else:
        ctx = None
        if tls is not None:
            ctx = tls_client_context(
                str(tls / "ca.pem"), str(tls / "client.pem"), str(tls / "client_key.pem")
            )
        pubs = [FramePublisher("127.0.0.1", ports[1], ssl_context=ctx) for _ in range(streams)]
    per = max(batch, updates // streams // batch * batch)
    # Every message pre-encoded: the publishers' own work stays out of the window.
    plans = [
        [
            {
                _name(k * per + m + j): engine_body((k * per + m + j) % ENGINES, m + j, 0.0)
                for j in range(batch)
            }
            for m in range(0, per, batch)
        ]
        for k in range(streams)
    ]
    for i in range(0, ENGINES, 50):  # every engine known before the window
        await pubs[0].publish(
            ENDPOINT_STATE_TYPE,
            {_name(j): engine_body(j, 0, 0.0) for j in range(i, min(ENGINES, i + 50))},
        )
    # Every connection made (TLS handshakes included) before the window too.
    await asyncio.gather(*(p.publish(ENDPOINT_STATE_TYPE, {}) for p in pubs))

    async def stream(k: int) -> None:
        for resources in plans[k]:
            await pubs[k].publish(ENDPOINT_STATE_TYPE, resources)

    before = cpu_seconds(pid)
    await asyncio.gather(*(stream(k) for k in range(streams)))
    spent = cpu_seconds(pid) - before
    for p in pubs:
        await p.close()
    return spent / (per * streams)


def _in_process(updates: int) -> float:
    """CPU seconds per update of ControlPlane.publish() itself, one update a call."""
    from xds.server import ControlPlane

    cp = ControlPlane()
    bodies = [(_name(i), engine_body(i % ENGINES, i, 0.0)) for i in range(updates)]
    for name, body in bodies[:ENGINES]:
        cp.publish(ENDPOINT_STATE_TYPE, {name: body})
    t = time.thread_time()
    for name, body in bodies[ENGINES:]:
        cp.publish(ENDPOINT_STATE_TYPE, {name: body})
    return (time.thread_time() - t) / max(1, updates - ENGINES)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.xds_ingest_bench", description=__doc__)
    ap.add_argument("--transports", default="grpc,frames", help="grpc, frames or both")
    ap.add_argument("--batches", default="1,10,50", help="updates per publish message")
    ap.add_argument("--updates", type=int, default=20_000, help="updates per batch size")
    ap.add_argument("--streams", type=int, default=8, help="concurrent publish streams")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds, each transport in turn in each (a shared machine's noise falls on "
        "both); each figure is the median",
    )
    ap.add_argument("--tls", action="store_true", help="mTLS on both ports")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    transports = [t for t in args.transports.split(",") if t]
    if not set(transports) <= {"grpc", "frames"}:
        ap.error("--transports: grpc and/or frames")
    rounds = max(1, args.rounds)
    local_s = asyncio.run(asyncio.to_thread(_in_process, args.updates))
    results: dict[str, Any] = {"publish_call_us": local_s * 1e6, "us_per_update": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tls = Path(tmp) if args.tls else None
        pems = _certificates(Path(tmp)) if tls is not None else None
        ours, theirs = mp.Pipe()
        proc = mp.Process(target=_control_plane, args=(theirs, pems))
        proc.start()
        try:
            ports = ours.recv()
            assert proc.pid is not None
            runs: dict[tuple[str, int], list[float]] = {}
            updates, streams = args.updates, args.streams
            for _ in range(rounds):
                for transport in transports:
                    for batch in batches:
                        run = _over(transport, ports, proc.pid, batch, updates, streams, tls)
                        runs.setdefault((transport, batch), []).append(asyncio.run(run) * 1e6)
            for (transport, batch), us in runs.items():
                row = results["us_per_update"].setdefault(transport, {})
                row[str(batch)] = statistics.median(us)
        finally:
            ours.send("stop")
            ours.recv()
            proc.join()
    if "grpc" in results["us_per_update"]:
        results["grpc_us_per_update"] = results["us_per_update"]["grpc"]
    print(f"control-plane CPU per ingested update ({args.updates} updates each, "
          f"{args.streams} publish streams, no subscribers, "
          f"{'mTLS' if args.tls else 'plaintext'}; median of {rounds} rounds)")  # fmt: skip
    print(f"  ControlPlane.publish() alone, in process      {local_s * 1e6:8.1f} us")
    for transport in transports:
        first = None
        for batch in batches:
            us = results["us_per_update"][transport][str(batch)]
            first = first or us
            print(f"  over {transport:6s} {batch:3d} update(s) a message      {us:8.1f} us"
                  f"   ({us / first:.2f}x of {batches[0]} a message)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
