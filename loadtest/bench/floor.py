"""The TTFT floor of a workload on a fleet: a latency no router can beat there.

For each planned request, in plan order: its time to first token on an idle engine of the
fleet's fastest GPU whose cache holds every full block of every earlier request's prompt
(one infinite cache, the notion of workloads.upper_bound_hit_rate), with no queue and no
network. Measured, not derived: a real EngineCore (the simulated engines' scheduler and
timing model, so chunked prefill and attention over the cached context are the engines'
own) with an unbounded block pool serves the requests one at a time, each up to its first
token; its prefix cache is the infinite cache. Prompts are built as the bench client
sends them (client.request_body) and parsed as the engine parses them (its tokenizer,
chat template and length checks); a request the engine would refuse gets no floor and
adds nothing to the cache. A dependent step (multi-turn, agentic) is rendered with empty
previous answers: the answers are unknown before the run, as for the hit-rate bound.

The fastest GPU: every GPU of the fleet that no other one dominates (at least as fast in
every term of the step time, a token budget that is a multiple of the other's, room for
requests at least as long: it then serves every request at least as fast, because merging
prefill steps never lengthens them); with several, each request takes the least.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loadtest.bench.client import DEFAULT_MODEL, request_body
from loadtest.bench.fleet import FleetSpec, engine_specs
from loadtest.bench.results import Distribution
from loadtest.engine import api
from loadtest.engine.config import EngineSpec
from loadtest.engine.core import EngineCore, RequestRejected, SimRequest, run_until_idle
from loadtest.engine.replica import EngineReplica
from loadtest.engine.tokenizer import Tokenizer, load_tokenizer
from loadtest.workloads import Message, PlannedRequest, render

# The floor engine's block pool: "infinite" (BlockPool only stores the blocks it uses).
UNBOUNDED_BLOCKS = 1 << 62
DEFINITION = (
    "idle engine of the fastest GPU, one infinite cache holding every earlier prompt's "
    "blocks, no queue, no network"
)


@dataclass(frozen=True, slots=True)
class TtftFloor:
    """Per-request floors (client seconds: simulated seconds / the fleet's time scale)."""

    gpu: str
    per_request: dict[str, float]
    unserved: tuple[str, ...]  # refused by the engine (too long), or after such a step
    wall_s: float
    time_scale: float = 1.0
    definition: str = DEFINITION
    ttft: Distribution = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ttft", Distribution.of(list(self.per_request.values())))

    def over(self, request_ids: Iterable[str]) -> Distribution:
        """The floor's distribution over some requests (those a policy served, say)."""
        floors = self.per_request
        return Distribution.of([floors[r] for r in request_ids if r in floors])

    def to_json(self) -> dict[str, Any]:
        d = self.ttft
        return {
            "definition": self.definition,
            "gpu": self.gpu,
            "requests": len(self.per_request),
            "unserved": len(self.unserved),
            "time_scale": self.time_scale,
            "wall_s": round(self.wall_s, 3),
            "ttft_s": {
                k: round(getattr(d, k), 6) for k in ("n", "mean", "p50", "p90", "p99", "max")
            },
        }


def _dominates(a: EngineCore, b: EngineCore) -> bool:
    """a is at least as fast as b for every request b can serve (module docstring)."""
    p, q = a.profile, b.profile
    return (
        p.prefill_tokens_per_s >= q.prefill_tokens_per_s
        and p.attn_s_per_pair <= q.attn_s_per_pair
        and p.weight_read_s <= q.weight_read_s
        and p.kv_read_s_per_token <= q.kv_read_s_per_token
        and p.step_overhead_s <= q.step_overhead_s
        and p.per_seq_overhead_s <= q.per_seq_overhead_s
        and p.block_size == q.block_size
        and a.max_num_batched_tokens % b.max_num_batched_tokens == 0
        and _max_request_tokens(a) >= _max_request_tokens(b)
        and a.config.hash_seed == b.config.hash_seed
    )


def _max_request_tokens(core: EngineCore) -> int:
    """The longest request (prompt + max_tokens) the engine accepts."""
    return min(core.max_model_len, core.profile.kv_blocks * core.block_size)


def fastest_specs(specs: Sequence[EngineSpec]) -> list[EngineSpec]:
    """One spec per kind of engine in the fleet that no other kind dominates (of kinds
    that time alike, the first)."""
    # What makes engines time alike: all but their names, ports, seeds and faults.
    distinct = list(
        dict.fromkeys(
            replace(
                s,
                name=None,
                port=0,
                seed=0,
                faults=(),
                kv_events_endpoint=None,
                kv_events_replay_endpoint=None,
            )
            for s in specs
        )
    )
    cores = [EngineReplica(s).core for s in distinct]
    keep = []
    for i, s in enumerate(distinct):
        beaten = any(
            _dominates(cores[j], cores[i]) and (j < i or not _dominates(cores[i], cores[j]))
            for j in range(len(distinct))
            if j != i
        )
        if not beaten:
            keep.append(s)
    return keep


def floors_on(
    spec: EngineSpec,
    requests: Sequence[PlannedRequest],
    *,
    tokenizer: Tokenizer | None = None,
    model: str | None = None,
) -> tuple[dict[str, float], list[str]]:
    """Simulated-seconds TTFT floors of `requests` on engines of `spec`, and the requests
    they cannot serve (see the module docstring)."""
    replica = EngineReplica(spec, tokenizer=tokenizer)
    capacity = replica.profile.kv_blocks
    unbounded = replace(replica.profile, kv_blocks=UNBOUNDED_BLOCKS)
    core = EngineCore(replace(replica.core.config, profile=unbounded), replica.generator)
    bs = core.block_size
    served_model = model or spec.model or DEFAULT_MODEL
    floors: dict[str, float] = {}
    unserved: list[str] = []
    last_sent: dict[str, str | tuple[Message, ...]] = {}
    now = 0.0
    for r in requests:
        chain = r.chain_id
        if r.depends_on_previous:
            previous = last_sent.get(chain) if chain is not None else None
            if previous is None:  # the client stops a chain at a failed step
                unserved.append(r.request_id)
                continue
            sent = render(r, previous, "")
        else:
            sent = render(r)
        try:
            parsed = replica.parse(r.kind, json.loads(request_body(r, sent, served_model)))
        except api.ApiError:
            unserved.append(r.request_id)
            continue
        n = len(parsed.prompt_ids)
        if -(-(n + parsed.max_tokens) // bs) > capacity:
            unserved.append(r.request_id)
            continue
        # One output token is all a floor needs: the prefill's steps do not depend on it.
        req = SimRequest(r.request_id, parsed.prompt_ids, 1, seed=parsed.seed, ignore_eos=True)
        try:
            core.submit(req, now)
        except RequestRejected:
            unserved.append(r.request_id)
            continue
        now, _ = run_until_idle(core, now)
        assert req.first_token_time is not None
        floors[r.request_id] = req.first_token_time - req.arrival
        if chain is not None:
            last_sent[chain] = sent
    return floors, unserved


def ttft_floor(
    requests: Sequence[PlannedRequest],
    fleet: FleetSpec,
    *,
    time_scale: float | None = None,
    model: str | None = None,
) -> TtftFloor | None:
    """The floor of `requests` on the sim fleet `fleet`; None for a stub fleet (no timing
    model). `time_scale`: simulated seconds per client second (default: the fleet's; a
    virtual clock's is 1)."""
    if fleet.kind != "sim":
        return None
    t0 = time.perf_counter()
    scale = fleet.time_scale if time_scale is None else time_scale
    best = fastest_specs(engine_specs(fleet))
    tokenizers: dict[str | None, Tokenizer] = {}
    per_gpu: list[tuple[str, dict[str, float]]] = []
    for spec in best:
        tok = tokenizers.get(spec.tokenizer)
        if tok is None:
            tok = tokenizers[spec.tokenizer] = load_tokenizer(spec.tokenizer)
        floors, _ = floors_on(spec, requests, tokenizer=tok, model=model)
        per_gpu.append((spec.gpu.upper(), floors))
    merged: dict[str, float] = {}
    for _, floors in per_gpu:
        for rid, t in floors.items():
            if rid not in merged or t < merged[rid]:
                merged[rid] = t
    # In plan order, so a distribution over a prefix reads the same requests.
    order = {r.request_id: i for i, r in enumerate(requests)}
    per_request = {rid: merged[rid] / scale for rid in sorted(merged, key=order.__getitem__)}
    unserved = tuple(r.request_id for r in requests if r.request_id not in merged)
    gpu = "/".join(dict.fromkeys(g for g, _ in per_gpu))
    return TtftFloor(gpu, per_request, unserved, time.perf_counter() - t0, scale)
