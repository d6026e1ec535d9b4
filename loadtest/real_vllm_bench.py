"""Routing policies in front of two real vLLM instances (loadtest/real_vllm.py), with a
shared-prefix workload; prefix-cache hit rates from vLLM's own /metrics.

    python -m loadtest.real_vllm_bench            # 8 groups x 12 questions per policy
    python -m loadtest.real_vllm_bench --quick    # 4 x 6, smaller caches

Each policy runs `meshd sidecar` (routing.policy round-robin, least-request, meshd) in
front of the same two engines, each on its own core (VLLM_CPU_OMP_THREADS_BIND); both
prefix caches are reset (POST /reset_prefix_cache) before each policy, and the hit rate is
the change of vllm:prefix_cache_hits_total over vllm:prefix_cache_queries_total during
its run. The caches are sized so that one engine holds half the groups' system prompts
but not all of them: what a prefix-aware router keeps apart, round robin thrashes. The
bound is what one infinite cache would hit on the same requests (full 32-token blocks
already seen, computed with the model's tokenizer). Needs `python -m loadtest.real_vllm
setup` first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest import real_vllm
from loadtest.bench.client import ClientSettings, run_load
from loadtest.bench.policies import ProcessRouter, sidecar_config, start_sidecar_process
from loadtest.workloads.generators import shared_prefix
from loadtest.workloads.request import PlannedRequest

POLICIES = ("round-robin", "least-request", "meshd")
_HITS = "vllm:prefix_cache_hits_total"
_QUERIES = "vllm:prefix_cache_queries_total"
_OK = "vllm:request_success_total"


def counters(url: str) -> dict[str, float]:
    text = real_vllm.get_text(url + "/metrics")
    out = {_HITS: 0.0, _QUERIES: 0.0, _OK: 0.0}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def reset_cache(url: str) -> None:
    req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        if not json.loads(r.read()).get("success"):
            raise RuntimeError(f"{url}: prefix cache reset refused (requests still running?)")


def infinite_cache_bound(requests: Sequence[PlannedRequest]) -> float:
    """Hit rate of one infinite prefix cache serving the requests in order (token-level,
    full blocks only, as vLLM counts)."""
    from tokenizers import Tokenizer

    from filters.vllm_blocks import VllmBlockHasher

    tok = Tokenizer.from_file(str(real_vllm.MODEL_DIR / "tokenizer.json"))
    h = VllmBlockHasher("sha256_cbor", real_vllm.BLOCK_SIZE)
    seen: set[int] = set()
    hit = total = 0
    for r in sorted(requests, key=lambda r: r.at_s):
        ids = tok.encode(r.prompt or "", add_special_tokens=True).ids
        hs = h.hashes(ids)
        k = 0
        while k < len(hs) and hs[k] in seen:
            k += 1
        hit += min(
            k * real_vllm.BLOCK_SIZE, (len(ids) - 1) // real_vllm.BLOCK_SIZE * real_vllm.BLOCK_SIZE
        )
        total += len(ids)
        seen.update(hs)
    return hit / total if total else 0.0


async def start_sidecar(
    endpoints: Sequence[dict[str, Any]], workdir: Path, policy: str
) -> ProcessRouter:
    """`meshd sidecar` in front of the engines, as loadtest.bench.policies starts it, but
    with each endpoint's KV capacity in its config (the picker's memory-headroom input)."""
    cfg = sidecar_config([e["url"] for e in endpoints], policy)
    cfg["pools"] = [{"name": "default", "endpoints": list(endpoints)}]
    return await start_sidecar_process(cfg, workdir)


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_policy(
    policy: str,
    insts: Sequence[real_vllm.VllmInstance],
    requests: Sequence[PlannedRequest],
    workdir: Path,
    concurrency: int,
    kv_capacity_tokens: int | None = None,
) -> dict[str, Any]:
    urls = [i.url for i in insts]
    eps: list[dict[str, Any]] = [{"url": u} for u in urls]
    if kv_capacity_tokens:
        for e in eps:
            e["kv_capacity_tokens"] = kv_capacity_tokens
    for u in urls:
        await asyncio.to_thread(reset_cache, u)
    before = [await asyncio.to_thread(counters, u) for u in urls]
    router = await start_sidecar(eps, workdir / policy, policy)
    try:
        settings = ClientSettings(
            model=real_vllm.SERVED_NAME,
            max_concurrency=concurrency,
            progress=True,
            progress_desc=policy,
        )
        run = await run_load(router.url, requests, settings)
    finally:
        await router.stop()
    after = [await asyncio.to_thread(counters, u) for u in urls]
    d = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    hits = sum(x[_HITS] for x in d)
    queries = sum(x[_QUERIES] for x in d)
    ok = [o for o in run.outcomes if o.ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    return {
        "policy": policy,
        "hit_rate": hits / queries if queries else 0.0,
        "per_engine_hit": [x[_HITS] / x[_QUERIES] if x[_QUERIES] else 0.0 for x in d],
        "per_engine_requests": [int(x[_OK]) for x in d],
        "success": len(ok) / max(1, len(run.outcomes)),
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p90": pct(ttft, 0.9),
        "wall_s": run.wall_s,
    }


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not real_vllm.available():
        raise SystemExit("no real vLLM here: run `python -m loadtest.real_vllm setup` first")
    requests = shared_prefix(
        groups=args.groups,
        questions_per_group=args.questions,
        system_prompt_tokens=args.system_words,
        question_tokens=24,
        max_tokens=args.max_tokens,
        rate=args.rate,
        seed=args.seed,
    )
    bound = infinite_cache_bound(requests)
    print(
        f"workload: shared-prefix, {args.groups} groups x {args.questions} questions, "
        f"{args.system_words}-word system prompts, rate {args.rate}/s; engines: 2 x vLLM "
        f"(vllm-cpu {real_vllm.VLLM_VERSION}, {args.num_blocks} blocks of "
        f"{real_vllm.BLOCK_SIZE} tokens each, one core each)",
        flush=True,
    )
    t0 = time.monotonic()
    with real_vllm.serving(
        2, hash_algo="sha256_cbor", num_blocks=args.num_blocks, dev_mode=True
    ) as insts:
        print(f"engines up in {time.monotonic() - t0:.0f} s", flush=True)
        with tempfile.TemporaryDirectory(prefix="meshd-real-bench-") as tmp:
            results = [
                await run_policy(
                    p,
                    insts,
                    requests,
                    Path(tmp),
                    args.concurrency,
                    args.num_blocks * real_vllm.BLOCK_SIZE if args.tell_kv else None,
                )
                for p in args.policies
            ]
    base = next((r for r in results if r["policy"] == "round-robin"), results[0])
    print()
    print(
        f"{'policy':<15}{'hit rate':>9}{'x rr':>7}{'of bound':>9}{'per engine':>14}"
        f"{'requests':>10}{'ok':>6}{'TTFT p50':>10}{'TTFT p90':>10}{'x rr':>7}"
    )
    for r in results:
        ratio = r["hit_rate"] / base["hit_rate"] if base["hit_rate"] else float("nan")
        tratio = r["ttft_p90"] / base["ttft_p90"] if base["ttft_p90"] else float("nan")
        per = "/".join(f"{x:.2f}" for x in r["per_engine_hit"])
        reqs = "/".join(str(x) for x in r["per_engine_requests"])
        print(
            f"{r['policy']:<15}{r['hit_rate']:>9.3f}{ratio:>7.2f}"
            f"{r['hit_rate'] / bound if bound else 0:>9.2f}{per:>14}{reqs:>10}"
            f"{r['success']:>6.0%}{r['ttft_p50'] * 1000:>8.1f}ms{r['ttft_p90'] * 1000:>8.1f}ms"
            f"{tratio:>7.2f}"
        )
    print(f"\ninfinite-cache bound: {bound:.3f}; total {time.monotonic() - t0:.0f} s")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.real_vllm_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="4 groups x 6 questions, 48 blocks")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--questions", type=int, default=12)
    p.add_argument("--system-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument(
        "--tell-kv",
        action="store_true",
        help="configure each endpoint's kv_capacity_tokens (num_blocks x block size)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.questions, args.system_words, args.num_blocks = 4, 6, 150, 48
        args.rate = 12.0
    results = asyncio.run(bench(args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
