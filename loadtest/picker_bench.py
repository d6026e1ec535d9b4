"""Pick-time benchmark for filters/picker.py: 64 endpoints, 32k-token prompts. Prints p50/p99
of a whole pick (hashes precomputed), of the index match alone, of hashing the prompt, and
of a naive O(blocks x endpoints) matcher over the same holdings, as a ratio.

Wall-clock percentiles on a shared machine include other processes' preemptions, so it
also prints the quietest round and thread CPU time, and, to tell the cyclic GC's share of
the tail from the rest, the percentiles of the picks no collection overlapped (--no-gc
turns the GC off, --gc-freeze moves the setup's objects out of its reach). --tail says
what the slowest 1% of picks (by CPU time) did that a median pick did not: index expiry
work, heap rebuilds, view rebuilds, a GC pass (it counts calls through wrappers, which
cost a little time themselves). Run:
`python -m loadtest.picker_bench [--endpoints 64] [--tokens 32768] [--picks 2000] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from filters.endpoint_state import EndpointState, ReportedState
from filters.hotpath import IMPLEMENTATION, block_hashes
from filters.picker import IMPLEMENTATION as PICK_IMPLEMENTATION
from filters.picker import Picker, PickRequest
from filters.prefix_index import PrefixIndex

# What --tail counts per pick: (class, method, label).
TAIL_EVENTS = (
    (PrefixIndex, "_work", "index expiry work"),
    (PrefixIndex, "_catch_up", "index catch-up"),
    (PrefixIndex, "_compact", "index heap rebuild"),
    (Picker, "_static_view", "static view rebuild"),
    (Picker, "_view", "view rebuild"),
)

GPUS = ("A100", "H100", "H200", "B200")
_VOCAB = (
    "the of and to in is that for it as with was on be by this are or from at an which have "
    "not they but one all were can there been if more when will would who so no out up into "
    "cache token engine prefix block route batch queue model prompt latency deadline"
)
WORDS = _VOCAB.split(" ")


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def _percentiles(samples_ns: Sequence[int]) -> tuple[float, float]:
    s = sorted(samples_ns)
    p50 = s[len(s) // 2] / 1000.0
    p99 = s[min(len(s) - 1, int(len(s) * 0.99))] / 1000.0
    return p50, p99


def _count_calls(events: Counter[str]) -> Callable[[], None]:
    """Wrap TAIL_EVENTS' methods to count their calls in `events`; returns the undo."""
    saved = []
    for cls, name, label in TAIL_EVENTS:
        f = getattr(cls, name)
        saved.append((cls, name, f))

        def counted(*a: Any, _f: Any = f, _label: str = label, **k: Any) -> Any:
            events[_label] += 1
            return _f(*a, **k)

        setattr(cls, name, counted)

    def undo() -> None:
        for cls, name, f in saved:
            setattr(cls, name, f)

    return undo


def tail_composition(picks: Sequence[tuple[int, Counter[str], bool]]) -> list[str]:
    """Lines saying how the slowest 1% of `picks` (CPU ns, calls, GC overlapped) differ from
    the middle 20%: the share of picks with each event and the calls per pick."""
    s = sorted(picks, key=lambda p: p[0])
    n = len(s)
    groups = (("middle 20%", s[int(n * 0.4) : int(n * 0.6)]), ("slowest 1%", s[int(n * 0.99) :]))
    labels = [label for _, _, label in TAIL_EVENTS]
    out = []
    for title, g in groups:
        parts = [f"{title} ({len(g)} picks, CPU >= {g[0][0] / 1000:.1f} us):"]
        for label in labels:
            with_it = sum(1 for _, c, _ in g if c[label])
            calls = sum(c[label] for _, c, _ in g) / len(g)
            parts.append(f"{label} {100 * with_it / len(g):.0f}% ({calls:.2f}/pick)")
        parts.append(f"GC pass {100 * sum(1 for *_, hit in g if hit) / len(g):.0f}%")
        plain = sum(1 for _, c, hit in g if not hit and not any(c[x] for x in labels[:4]))
        parts.append(f"none of these but view rebuilds {100 * plain / len(g):.0f}%")
        out.append("    " + "; ".join(parts))
    return out


def naive_match(held: dict[str, set[int]], hashes: Sequence[int]) -> dict[str, int]:
    """The O(blocks x endpoints) reference: walk the chain once per endpoint."""
    out: dict[str, int] = {}
    for name, blocks in held.items():
        k = 0
        for h in hashes:
            if h not in blocks:
                break
            k += 1
        if k:
            out[name] = k
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoints", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32_768, help="prompt length in tokens")
    ap.add_argument("--docs", type=int, default=24, help="distinct shared documents")
    ap.add_argument("--picks", type=int, default=2000, help="picks per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--no-gc", action="store_true", help="disable the cyclic GC while timing (default: on)"
    )
    ap.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() the setup's objects before timing"
    )
    ap.add_argument(
        "--tail", action="store_true", help="what the slowest 1%% of picks did (see above)"
    )
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)

    endpoints = [
        EndpointState(f"e{i:02d}", url=f"http://10.0.0.{i}:8000", gpu=GPUS[i % len(GPUS)])
        for i in range(args.endpoints)
    ]
    for i, e in enumerate(endpoints):
        e.report(
            ReportedState(
                epoch=1,
                kv_block_size=16,
                kv_capacity_blocks=60_000,
                kv_usage=rng.random() * 0.8,
                requests_running=rng.randrange(0, 48),
                requests_waiting=rng.randrange(0, 4),
                models={"llama": True},
            ),
            0.0,
        )
        e.report_ttl_s = 1e9
        for j in range(rng.randrange(0, 6)):
            e.start(("warm", i, j), 0.0, prompt_tokens=2000, max_tokens=200)

    chars = args.tokens * 4
    docs = [_text(rng, chars) for _ in range(args.docs)]
    model = "llama"
    t_hash = time.perf_counter_ns()
    reqs: list[PickRequest] = []
    hash_samples: list[int] = []
    for k in range(256):
        text = docs[k % len(docs)][: chars - 400] + _text(rng, 400)
        t0 = time.perf_counter_ns()
        hashes = block_hashes(text, model)
        hash_samples.append(time.perf_counter_ns() - t0)
        reqs.append(PickRequest(model, hashes, prompt_tokens=len(text) // 4, max_tokens=256))
    t_hash = time.perf_counter_ns() - t_hash
    blocks = len(reqs[0].block_hashes)

    picker = Picker()
    now = 1.0
    # Warm the index: every document lands somewhere (hot ones on two or three endpoints).
    for i in range(600):
        now += 0.01
        picker.pick(reqs[i % len(reqs)], endpoints, now)

    # Steady state as a driver makes it: each pick is dispatched; the request dispatched 4
    # picks earlier gets its first token and the one 32 picks earlier finishes, so every
    # pick finds about three endpoint changes to fold into its cached views.
    inflight: deque[tuple[EndpointState, int]] = deque()
    rounds: list[tuple[list[int], list[int]]] = []
    match_samples: list[int] = []
    clock = time.perf_counter_ns
    cpu = time.thread_time_ns
    rid = 0
    collections = [0]  # cyclic GC passes started so far

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections[0] += 1

    overlapped: list[bool] = []  # per timed pick: did a collection run inside it
    gc.collect()
    if args.gc_freeze:
        gc.freeze()
    if args.no_gc:
        gc.disable()
    gc.callbacks.append(on_gc)
    events: Counter[str] = Counter()
    undo = _count_calls(events) if args.tail else None
    tail: list[tuple[int, Counter[str], bool]] = []
    try:
        for _ in range(args.rounds):
            wall: list[int] = []
            cpu_ns: list[int] = []
            for _ in range(args.picks):
                now += 0.02  # 50 picks/s of virtual time: the run outlives the index TTL
                r = reqs[rng.randrange(len(reqs))]
                g0 = collections[0]
                c0 = cpu()
                t0 = clock()
                out = picker.pick(r, endpoints, now)
                t1 = clock()
                c1 = cpu()
                wall.append(t1 - t0)
                cpu_ns.append(c1 - c0)
                overlapped.append(collections[0] != g0)
                if undo is not None:
                    tail.append((c1 - c0, events.copy(), collections[0] != g0))
                    events.clear()
                picker.dispatch(out[0], r, rid, now)
                inflight.append((out[0].state, rid))
                rid += 1
                if len(inflight) > 4:
                    st, first = inflight[-5]
                    st.first_token(first, now)
                if len(inflight) > 32:
                    st, done = inflight.popleft()
                    st.finish(done, now)
                if rid % 10 == 0:
                    t2 = clock()
                    picker.index.match_detail(r.block_hashes, now)
                    match_samples.append(clock() - t2)
            rounds.append((wall, cpu_ns))
        held = {e.name: picker.index.held(e.name) for e in endpoints}
        sample_reqs = [reqs[rng.randrange(len(reqs))] for _ in range(40)]
        naive_samples: list[int] = []
        for r in sample_reqs:
            t0 = clock()
            naive_match(held, r.block_hashes)
            naive_samples.append(clock() - t0)
        agree = all(
            picker.index.match(r.block_hashes, now) == naive_match(held, r.block_hashes)
            for r in sample_reqs[:10]
        )
    finally:
        if undo is not None:
            undo()
        gc.callbacks.remove(on_gc)
        gc.enable()
        if args.gc_freeze:
            gc.unfreeze()

    pick_samples = [t for wall, _ in rounds for t in wall]
    cpu_samples = [t for _, c in rounds for t in c]
    quiet = min(rounds, key=lambda rc: _percentiles(rc[0])[1])
    p50, p99 = _percentiles(pick_samples)
    c50, c99 = _percentiles(cpu_samples)
    q50, q99 = _percentiles(quiet[0])
    m50, m99 = _percentiles(match_samples)
    h50, h99 = _percentiles(hash_samples)
    n50, n99 = _percentiles(naive_samples)
    no_gc_samples = [t for t, hit in zip(cpu_samples, overlapped, strict=True) if not hit]
    g50, g99 = _percentiles(no_gc_samples)
    gc_mode = "off" if args.no_gc else ("on, setup frozen" if args.gc_freeze else "on")
    print(
        f"picker bench: {args.endpoints} endpoints, ~{args.tokens} tokens "
        f"({blocks} blocks of 64 B), {args.rounds} x {args.picks} picks, "
        f"hashing: {IMPLEMENTATION}, pick loop: {PICK_IMPLEMENTATION}, cpus: {os.cpu_count()}, "
        f"gc: {gc_mode}"
    )
    print(f"  pick, wall (hashes precomputed) p50 {p50:8.1f} us   p99 {p99:8.1f} us")
    print(f"  pick, quietest round             p50 {q50:8.1f} us   p99 {q99:8.1f} us")
    print(f"  pick, thread CPU time            p50 {c50:8.1f} us   p99 {c99:8.1f} us")
    print(
        f"  pick, CPU, no GC pass inside     p50 {g50:8.1f} us   p99 {g99:8.1f} us   "
        f"({len(cpu_samples) - len(no_gc_samples)} of {len(cpu_samples)} picks overlapped "
        "a collection)"
    )
    print(f"  index match alone                p50 {m50:8.1f} us   p99 {m99:8.1f} us")
    print(f"  block hashing of the prompt      p50 {h50:8.1f} us   p99 {h99:8.1f} us")
    print(f"  naive matcher (baseline)         p50 {n50:8.1f} us   p99 {n99:8.1f} us")
    print(
        f"  naive / index match: {n50 / max(m50, 1e-9):.0f}x at p50; "
        f"index agrees with naive: {agree}; index nodes {picker.index.node_count()}; "
        f"mean pick {statistics.fmean(pick_samples) / 1000:.1f} us; "
        f"hashing {t_hash / 1e6:.0f} ms for {len(reqs)} prompts"
    )
    if tail:
        print("  tail composition (--tail; counted through wrappers):")
        for line in tail_composition(tail):
            print(line)


if __name__ == "__main__":
    main()
