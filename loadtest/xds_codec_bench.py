"""Encode/decode cost of xDS DiscoveryResponse / DeltaDiscoveryResponse in the two Python
bindings of Envoy's API: `xds-protos` (Google protobuf, upb in C) and `envoy-data-plane`
(betterproto2 dataclasses, pure Python). Decides which one xds/ uses.

Then a subscriber's side: µs per EndpointState resource decoded and applied
(Subscriber._apply), the one-pass decoder against the field-by-field one it replaced and
against bare msgpack.unpackb of the same bodies, measured in the same run.

With `--fanout`: the control plane's fan-out path in-process, without gRPC: E engines
publish (EndpointState, EDS view on or off), each flush hands the changes to S delta
wildcard subscribers and builds their responses; CPU microseconds per published update,
split into publish (validate, cache, EDS) and push (flush + build responses for all S), the
push compared with building each response as a protobuf message and serializing it per
subscriber (what xds/server.py did before it shared encoded frames), measured in the same
run.

Run: .venv/bin/python -m loadtest.xds_codec_bench [--resources 100] [--rounds 200] [--apply]
     .venv/bin/python -m loadtest.xds_codec_bench --fanout [--engines 1000]
         [--subscribers 100] [--per-flush 100] [--updates 5000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack

import xds  # noqa: F401  (makes xds-protos' own `xds` package importable; see xds/__init__.py)

TYPE_URL = "type.googleapis.com/meshd.v1.EndpointState"


def _payload(i: int) -> bytes:
    # Roughly an EndpointState resource as xds/resources.py encodes it (~300 bytes).
    return msgpack.packb(
        {
            "address": f"10.0.{i // 250}.{i % 250}:8000",
            "pool": "h100-pool",
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "adapters": {"sql-lora": True, "chat-lora": False},
            "gpu": "H100",
            "gpu_count": 8,
            "memory_total_bytes": 80 * 2**30,
            "memory_used_bytes": 61 * 2**30 + i,
            "kv_block_size": 16,
            "kv_capacity_blocks": 40000,
            "kv_usage": 0.42,
            "requests_running": 17,
            "requests_waiting": 3,
            "tokens_in_flight": 48213,
            "ttft_s": 0.183,
            "tpot_s": 0.021,
            "healthy": True,
            "draining": False,
            "epoch": "3f2a9c",
        }
    )


def _timeit(fn: Callable[[], object], rounds: int) -> float:
    """Median microseconds per call over `rounds` calls (after a warm-up)."""
    for _ in range(min(20, rounds)):
        fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def bench_xds_protos(n: int, rounds: int) -> dict[str, float]:
    from envoy.service.discovery.v3 import discovery_pb2 as d
    from google.protobuf import any_pb2

    payloads = [_payload(i) for i in range(n)]

    def sotw() -> bytes:
        r = d.DiscoveryResponse(version_info="42", type_url=TYPE_URL, nonce="17")
        for p in payloads:
            r.resources.append(any_pb2.Any(type_url=TYPE_URL, value=p))
        return r.SerializeToString()

    def delta() -> bytes:
        r = d.DeltaDiscoveryResponse(system_version_info="42", type_url=TYPE_URL, nonce="17")
        for i, p in enumerate(payloads):
            res = r.resources.add(name=f"engine-{i}", version=f"{i:016x}")
            res.resource.type_url = TYPE_URL
            res.resource.value = p
        return r.SerializeToString()

    sotw_bytes, delta_bytes = sotw(), delta()
    return {
        "sotw_encode_us": _timeit(sotw, rounds),
        "sotw_decode_us": _timeit(lambda: d.DiscoveryResponse.FromString(sotw_bytes), rounds),
        "delta_encode_us": _timeit(delta, rounds),
        "delta_decode_us": _timeit(
            lambda: d.DeltaDiscoveryResponse.FromString(delta_bytes), rounds
        ),
        "sotw_bytes": len(sotw_bytes),
        "delta_bytes": len(delta_bytes),
    }


def bench_envoy_data_plane(n: int, rounds: int) -> dict[str, float]:
    from envoy_data_plane.envoy.service.discovery.v3 import (
        DeltaDiscoveryResponse,
        DiscoveryResponse,
        Resource,
    )
    from envoy_data_plane.google.protobuf import Any

    payloads = [_payload(i) for i in range(n)]

    def sotw() -> bytes:
        r = DiscoveryResponse(
            version_info="42",
            type_url=TYPE_URL,
            nonce="17",
            resources=[Any(type_url=TYPE_URL, value=p) for p in payloads],
        )
        return bytes(r)

    def delta() -> bytes:
        r = DeltaDiscoveryResponse(
            system_version_info="42",
            type_url=TYPE_URL,
            nonce="17",
            resources=[
                Resource(
                    name=f"engine-{i}",
                    version=f"{i:016x}",
                    resource=Any(type_url=TYPE_URL, value=p),
                )
                for i, p in enumerate(payloads)
            ],
        )
        return bytes(r)

    sotw_bytes, delta_bytes = sotw(), delta()
    return {
        "sotw_encode_us": _timeit(sotw, rounds),
        "sotw_decode_us": _timeit(lambda: DiscoveryResponse.parse(sotw_bytes), rounds),
        "delta_encode_us": _timeit(delta, rounds),
        "delta_decode_us": _timeit(lambda: DeltaDiscoveryResponse.parse(delta_bytes), rounds),
        "sotw_bytes": len(sotw_bytes),
        "delta_bytes": len(delta_bytes),
    }


# -- the fan-out path ---------------------------------------------------------------------


def _legacy_delta(stream: object, sub: object) -> bytes | None:
    """The response the server built before frames were shared: a protobuf message per
    subscriber, serialized by gRPC (same bookkeeping as xds/server.py _Stream.build_delta)."""
    from envoy.service.discovery.v3 import discovery_pb2 as pb

    from xds.server import _Stream, _Subscription

    assert isinstance(stream, _Stream) and isinstance(sub, _Subscription)
    cache, t = stream.cp.cache, sub.type_url
    table = cache.resources(t)
    candidates, sub.pending = sub.pending, set()
    resp = pb.DeltaDiscoveryResponse(type_url=t, system_version_info=str(cache.type_version(t)))
    for name in sorted(candidates):
        r = table.get(name)
        if r is None or sub.sent.get(name) == r.version:
            continue
        sub.sent[name] = r.version
        res = resp.resources.add(name=name, version=r.version)
        res.resource.type_url = t
        res.resource.value = r.body
    if not resp.resources:
        return None
    resp.nonce = stream._next_nonce(sub)
    out: bytes = resp.SerializeToString()
    return out


def bench_fanout(
    engines: int,
    subscribers: int,
    per_flush: int,
    updates: int,
    *,
    eds: bool,
    legacy: bool,
    envoy: bool = False,
) -> dict[str, float]:
    """CPU µs per update: publish side and push side (flush + all subscribers' responses).
    `envoy`: one more stream follows the EDS view (every pool's ClusterLoadAssignment)."""
    from envoy.service.discovery.v3 import discovery_pb2 as pb

    from loadtest.xds_scale_bench import T, engine_body
    from xds.eds import CLA_TYPE
    from xds.server import ControlPlane, _Stream

    cp = ControlPlane(eds=eds)
    streams = []
    for k in range(subscribers + int(envoy)):
        s = _Stream(cp, f"sub-{k}", delta=True)
        t = CLA_TYPE if k == subscribers else T
        s.on_delta_request(pb.DeltaDiscoveryRequest(type_url=t, resource_names_subscribe=["*"]))
        cp._streams.add(s)
        streams.append(s)
    for i in range(engines):
        cp.publish(T, {f"engine-{i:05d}": engine_body(i, 0, 0.0)})
    bodies = [engine_body(i % engines, 1 + i // engines, 0.0) for i in range(updates)]
    publish_s = push_s = 0.0
    sent_bytes = 0

    def push() -> int:
        cp.flush()
        n = 0
        for s in streams:
            for t, sub in list(s.subs.items()):
                if legacy:
                    out = _legacy_delta(s, sub)
                    n += len(out) if out is not None else 0
                    sub.unacked.clear()  # the client ACKed
                    continue
                p = s.next_push(sub)
                if p is not None:
                    n += len(p.payload)
                    # The client ACKs, as over the wire.
                    s.on_delta_request(pb.DeltaDiscoveryRequest(type_url=t, response_nonce=p.nonce))
        return n

    push()  # everyone synced
    for start in range(0, updates, per_flush):
        t0 = time.process_time()
        for i in range(start, min(updates, start + per_flush)):
            cp.publish(T, {f"engine-{i % engines:05d}": bodies[i]})
        t1 = time.process_time()
        sent_bytes += push()
        publish_s += t1 - t0
        push_s += time.process_time() - t1
    return {
        "publish_us": publish_s / updates * 1e6,
        "push_us": push_s / updates * 1e6,
        "bytes_per_update": sent_bytes / updates,
    }


def fanout_main(args: argparse.Namespace) -> int:
    print(
        f"fan-out in-process: {args.engines} engines, {args.subscribers} delta subscribers, "
        f"{args.per_flush} updates per flush, {args.updates} updates; CPU µs per update"
    )
    print(f"{'path':36}{'publish':>10}{'push':>10}{'push/sub':>10}{'bytes/upd':>12}")
    rows = {}
    for label, eds, legacy, envoy in (
        ("protobuf per subscriber, EDS off", False, True, False),
        ("shared frames, EDS off", False, False, False),
        ("shared frames, EDS on, no Envoy", True, False, False),
        ("shared frames, EDS on, + 1 Envoy", True, False, True),
    ):
        r = bench_fanout(
            args.engines,
            args.subscribers,
            args.per_flush,
            args.updates,
            eds=eds,
            legacy=legacy,
            envoy=envoy,
        )
        rows[label] = r
        print(
            f"{label:36}{r['publish_us']:10.1f}{r['push_us']:10.1f}"
            f"{r['push_us'] / args.subscribers:10.2f}{r['bytes_per_update']:12,.0f}"
        )
    base, new = rows["protobuf per subscriber, EDS off"], rows["shared frames, EDS off"]
    ratio = new["push_us"] / base["push_us"]
    print(f"push: shared frames cost x{ratio:.2f} of protobuf per subscriber")
    return 0


# -- a subscriber applying EndpointState resources ---------------------------------------


def _legacy_apply(sub: Any, resp: Any) -> Any:
    """Subscriber._apply as it was before the one-pass decoder (xds/client.py; run with the
    field-by-field decoder): protobuf fields read again per use, Entry built through its
    frozen dataclass __init__."""
    from types import MappingProxyType

    from envoy.service.discovery.v3 import discovery_pb2 as pb

    from xds.client import Entry, Update
    from xds.resources import ResourceError

    now = sub._clock()
    sub._last_update_at = now
    sub.stats.responses += 1
    t = resp.type_url
    reply = pb.DeltaDiscoveryRequest(type_url=t, response_nonce=resp.nonce)
    interest = sub._interest.get(t)
    if interest is None:
        return reply
    decoder = sub._decoders.get(t)
    changed: dict[str, Entry] = {}
    try:
        for r in resp.resources:
            if not (interest.wildcard or r.name in interest.names):
                continue
            if r.resource.type_url != t:
                raise ResourceError(f"Any type {r.resource.type_url!r} in a {t} response")
            try:
                value = r.resource.value if decoder is None else decoder(r.resource.value)
            except ResourceError as exc:
                raise ResourceError(f"{r.name}: {exc}") from None
            changed[r.name] = Entry(r.name, r.version, value, now)
    except ResourceError as exc:
        sub.stats.nacks += 1
        reply.error_detail.message = str(exc)
        return reply
    table = sub._state.setdefault(t, {})
    table.update(changed)
    removed = frozenset(n for n in resp.removed_resources if table.pop(n, None) is not None)
    sub.stats.acks += 1
    if sub._on_update is not None and (changed or removed):
        sub._on_update(Update(t, MappingProxyType(changed), removed))
    return reply


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median microseconds per call of each, the candidates taking turns within every
    round (on a shared machine, a busy spell then slows all of them alike)."""
    for fn in fns.values():
        for _ in range(min(20, rounds)):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in samples.items()}


def bench_apply(n: int, rounds: int) -> dict[str, float]:
    """µs per EndpointState resource: bare msgpack.unpackb of its body, decoding it (the
    one-pass decoder and the field-by-field one it replaced), and a subscriber applying a
    response of `n` of them (Subscriber._apply, and the old _apply with the old decoder)."""
    from envoy.service.discovery.v3 import discovery_pb2 as pb

    from loadtest.xds_scale_bench import engine_body
    from xds.client import Subscriber
    from xds.resources import _decode_endpoint_state_checked, decode_endpoint_state

    msg = pb.DeltaDiscoveryResponse(type_url=TYPE_URL, nonce="1")
    for i in range(n):
        r = msg.resources.add(name=f"engine-{i:05d}", version=f"{i:016x}")
        r.resource.type_url = TYPE_URL
        r.resource.value = engine_body(i, 1, time.monotonic())
    raw = msg.SerializeToString()  # as gRPC hands it to Subscriber._apply
    resp = pb.DeltaDiscoveryResponse.FromString(raw)  # as the old path received it
    bodies = [r.resource.value for r in resp.resources]
    new = Subscriber("127.0.0.1:1", {TYPE_URL: None}, on_update=lambda u: None)
    old = Subscriber(
        "127.0.0.1:1",
        {TYPE_URL: None},
        decoders={TYPE_URL: _decode_endpoint_state_checked},
        on_update=lambda u: None,
    )
    unpackb = msgpack.unpackb

    def each(fn: Callable[[bytes], object]) -> Callable[[], None]:
        def run() -> None:
            for b in bodies:
                fn(b)

        return run

    us = _interleaved(
        {
            "unpackb": each(lambda b: unpackb(b, raw=False, strict_map_key=True)),
            "decode_old": each(_decode_endpoint_state_checked),
            "decode_new": each(decode_endpoint_state),
            "apply_old": lambda: _legacy_apply(old, resp),
            "apply_new": lambda: new._apply(raw),
        },
        rounds,
    )
    return {k: v / n for k, v in us.items()}


def apply_main(n: int, rounds: int) -> None:
    r = bench_apply(n, rounds)
    print(
        f"\ndecode+apply one EndpointState ({n} per response, median of {rounds} rounds, "
        "µs per resource)"
    )
    print(f"{'':34}{'old':>10}{'new':>10}{'new/old':>10}{'old/unpackb':>13}{'new/unpackb':>13}")
    u = r["unpackb"]
    print(f"{'msgpack.unpackb alone':34}{u:10.2f}")
    for label, k in (("decode", "decode"), ("decode+apply (Subscriber._apply)", "apply")):
        o, w = r[f"{k}_old"], r[f"{k}_new"]
        print(f"{label:34}{o:10.2f}{w:10.2f}{w / o:10.2f}{o / u:13.2f}{w / u:13.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resources", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--fanout", action="store_true", help="the control plane's fan-out path")
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--subscribers", type=int, default=100)
    ap.add_argument("--per-flush", type=int, default=100, help="updates between flushes")
    ap.add_argument("--updates", type=int, default=5000)
    ap.add_argument("--apply", action="store_true", help="only the subscriber's decode+apply line")
    args = ap.parse_args(argv)
    if args.fanout:
        return fanout_main(args)
    if not args.apply:
        bindings_main(args.resources, args.rounds)
    apply_main(args.resources, args.rounds)
    return 0


def bindings_main(n: int, rounds: int) -> None:
    from google.protobuf.internal import api_implementation

    results = {f"xds-protos ({api_implementation.Type()})": bench_xds_protos(n, rounds)}
    try:
        results["envoy-data-plane (betterproto2)"] = bench_envoy_data_plane(n, rounds)
    except ImportError:  # not a dependency since xds/ chose xds-protos
        print("(envoy-data-plane is not installed: xds-protos alone)")
    keys = ["sotw_encode_us", "sotw_decode_us", "delta_encode_us", "delta_decode_us"]
    print(f"{n} resources per message, median of {rounds} rounds (µs)")
    print(f"{'binding':34}" + "".join(f"{k[:-3]:>15}" for k in keys) + f"{'bytes (delta)':>15}")
    for name, r in results.items():
        row = "".join(f"{r[k]:15.1f}" for k in keys)
        print(f"{name:34}{row}{int(r['delta_bytes']):15d}")
    if len(results) == 2:
        a, b = results.values()
        ratio = "".join(f"{b[k] / a[k]:14.1f}x" for k in keys)
        print(f"{'betterproto / protobuf':34}{ratio}")


if __name__ == "__main__":
    raise SystemExit(main())
