"""Encode/decode cost of xDS DiscoveryResponse / DeltaDiscoveryResponse in the two Python
bindings of Envoy's API: `xds-protos` (Google protobuf, upb in C) and `envoy-data-plane`
(betterproto2 dataclasses, pure Python). Decides which one xds/ uses.

Run: .venv/bin/python -m loadtest.xds_codec_bench [--resources 100] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resources", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    from google.protobuf.internal import api_implementation

    results = {
        f"xds-protos ({api_implementation.Type()})": bench_xds_protos(args.resources, args.rounds),
        "envoy-data-plane (betterproto2)": bench_envoy_data_plane(args.resources, args.rounds),
    }
    keys = ["sotw_encode_us", "sotw_decode_us", "delta_encode_us", "delta_decode_us"]
    print(f"{args.resources} resources per message, median of {args.rounds} rounds (µs)")
    print(f"{'binding':34}" + "".join(f"{k[:-3]:>15}" for k in keys) + f"{'bytes (delta)':>15}")
    for name, r in results.items():
        row = "".join(f"{r[k]:15.1f}" for k in keys)
        print(f"{name:34}{row}{int(r['delta_bytes']):15d}")
    a, b = results.values()
    ratio = "".join(f"{b[k] / a[k]:14.1f}x" for k in keys)
    print(f"{'betterproto / protobuf':34}{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
