"""Prefill/decode disaggregation, the sans-I/O part: whether a request is worth splitting
(the decider), and the bodies of the two disaggregated-serving protocols meshd speaks:
vLLM's (protocol `vllm-nixl`) and SGLang's (protocol `sglang`).

The protocol is vLLM's with the NIXL connector, as vLLM's own proxy speaks it
(vllm-project/vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py):
1. the prefill step goes to a prefill engine: the client's request with
   `kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`,
   `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1` when set), without
   `stream_options`, `min_tokens` and `min_completion_tokens`; the engine prefills, keeps
   the KV and answers with the `kv_transfer_params` the decode side needs (remote engine
   id, block ids, host, port);
2. the decode step goes to a decode engine: the client's request as it came plus those
   `kv_transfer_params`; the engine pulls the KV and generates, streamed to the client as
   the one answer.
Both legs carry the same `X-Request-Id`.

SGLang's protocol, as its routers speak it (sgl-project/sglang
python/sglang/srt/disaggregation/mini_lb.py, and sgl-model-gateway's PD router,
src/routers/http/pd_router.rs `inject_bootstrap_into_value`, pd_types.rs
`generate_room_id`): the client's request, with `bootstrap_host` (the prefill engine's
hostname, from its URL), `bootstrap_port` (its `--disaggregation-bootstrap-port`, 8998 by
default; null lets the engine use its own) and `bootstrap_room` (a random integer in
[0, 2**63 - 1], new for every request) added, goes to a prefill engine and a decode
engine at once; the prefill engine sends the KV to the decode engine that joins the same
room, and the client's answer is the decode engine's. A batched request carries one of
each per item, as lists (`bootstrap_batch`). SGLang's decode engines refuse a request
without a room ("Disaggregated request received without bootstrap room id"), so under
this protocol nothing is served whole on the decode pool.

The decider (llm-d's prefix-based pd-decider, in tokens, and the link): with P prompt
tokens, U of them not cached at the best prefill engine, C of them held by the decode
engine that holds the most (its pool's prefix index; 0 when unknown), the KV transfer
T = (P - C) x KV bytes per token / the link's bandwidth (a decode engine pulls only the
blocks its prefix cache lacks: vLLM's NIXL connector loads the prompt less what it
computed locally), a request is split when
1. a prefill engine can take it (else whole: `no-prefill-engine`),
2. min(U, P - C) >= `min_prefill_tokens` (else `short-prefill`: a short prefill is
   cheaper done where the decode runs than shipped as KV; short at the prefill engine, or
   at the decode engine that holds all but P - C of the prompt, as a conversation's next
   turn does where its last one was decoded), and
3. T < U x r, r the decode pool's seconds per prefilled token at its GPUs' nominal speed
   (else `transfer-slower`: shipping the prompt's KV would keep the decode engine waiting
   longer than computing the uncached part itself; a prompt mostly cached, or a slow link).
At 50 GB/s and 128 KiB a token (2.6 us) against an H100's 36 us a token, rule 3 serves
whole a prompt more than 93% cached; at 5 GB/s, more than 27%. Then, where the decode
pool's router predicts (meshd's picker; `prefer_whole`):
4. the request goes whole (`faster-whole`) when the decode engine it would take whole is
   predicted to give its first token sooner than the split (the best prefill engine's
   predicted TTFT, its queue included, plus the decode leg's: the transfer and the wait
   on the decode engine it would take) by more than
       `faster_whole_margin_s` + `faster_whole_stall_weight` x r x W,
   r the streams decoding on that engine and W the request's predicted TTFT there: its
   prefill chunks stall each of those streams for about that long (a step of up to
   max_num_batched_tokens of prefill between two of their tokens). A prefill pool that
   queues so lends its overflow to the decode engines' compute, which decode leaves
   idle, where the first token gained is worth the stall; a short prompt, or an engine
   with few streams, needs less. Why (loadtest/pd_bench, 5 prefill + 3 decode H100s,
   Mooncake's long prompts at 5/s, 2026-12-07): the prefill leg is ~95% of a split
   request's TTFT at p90 (the decode leg, transfer and wait, 60-90 ms), and the prefill
   pool runs at ~75% of its compute, so its queue makes the tail; meshd's prefill choice
   already matched least-work-left routing (an FCFS model of the same arrivals on 5
   engines: TTFT p90 1.53 s, round robin 2.02 s, 0.76x; measured 0.74-0.76x), so the
   prefill choice alone could not reach 0.7x. Measured, TTFT p90 meshd / round robin,
   ITL p99, requests whole: the rule off 0.74-0.76x, 21-22 ms, 0; margin 0.1 s and
   stall weight 0.2 (the defaults) 0.56-0.63x, 27-44 ms, 12-14% (gaps over 200 ms 0.4%
   of all); weight 0.1, 0.63x, 61 ms, 16% (0.8%); no stall term, margin 0.6 s, 0.62-0.64x,
   48-90 ms, 14% (0.95%: at the ITL p99's cliff, where the stalled gaps pass 1%), margin
   0.3 s, 325 ms (the aggregated fleet's ITL). The ledger's $ per successful task stayed
   within its run-to-run spread, 1.004-1.005x aggregated meshd's (rule off, same tree:
   1.003-1.006x: a few shared prefixes the 5 prefill engines' caches had evicted where
   the 8 aggregated engines' had not); the engines' busy GPU-seconds per task 0.85x ->
   0.82-0.83x. Known gap: a decode engine's TTFT calibration learns only from requests
   served whole there (a decode leg's first token times the transfer, not the engine),
   so W starts at the datasheet's speed (the bench's engines, at half a GPU's speed,
   took 1.9x the W predicted at first, 1.25x by the end), and a decode leg may be sent
   to an engine still prefilling a whole request (31 of the 35 decode legs over 150 ms).

Under SGLang's protocol every request that a prefill engine can take is split (its
decode engines serve nothing whole). The transfer is also part of a split request's
predicted TTFT: the prefill engine's predicted TTFT, then T, then the decode engine's wait
(Picker.order_decode); in the decode leg's order each engine's own (P - C_e) is priced
(`price_decode_routes`), so an engine that holds an earlier turn gets the KV sooner.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from filters.pool_router import Route

__all__ = [
    "BOOTSTRAP_FIELDS",
    "BOOTSTRAP_RETRY_S",
    "FASTER_WHOLE_MARGIN_S",
    "FASTER_WHOLE_STALL_WEIGHT",
    "KV_PARAMS",
    "MAX_NAMED_PREFILL",
    "MAX_PD_HEADER_CHARS",
    "MAX_ROOM",
    "PD_HEADER",
    "PREFILL_HEADERS",
    "SGLANG_BOOTSTRAP_PORT",
    "BootstrapPorts",
    "PdServed",
    "Split",
    "aggregated_body",
    "bootstrap_batch",
    "bootstrap_body",
    "bootstrap_port_of",
    "decide_split",
    "decode_body",
    "leg_answer",
    "missing_tokens",
    "named_prefill_endpoints",
    "new_room",
    "parse_pd_header",
    "prefer_whole",
    "prefill_body",
    "price_decode_routes",
    "transfer_params",
    "transfer_seconds",
]

KV_PARAMS = "kv_transfer_params"
# The prefill endpoints an endpoint picker chose for a request it routes to a decode
# endpoint, `ip:port[,ip:port...]`, first to try first: the Gateway API Inference
# Extension's proposed standard header (kubernetes-sigs/gateway-api-inference-extension,
# the proposal "Upstreaming Prefill/Decode Disaggregation Support"), then llm-d's (its
# routing sidecar reads `x-prefiller-host-port`, llm-d-inference-scheduler
# pkg/sidecar/proxy/chat_completions.go). Read in this order; `meshd picker` sets both.
PREFILL_HEADERS = ("x-gateway-prefill-endpoints", "x-prefiller-host-port")
# At most this many endpoints are read from one header (the rest are ignored).
MAX_NAMED_PREFILL = 8
# Rule 4's defaults (disaggregation.faster_whole_margin_s and faster_whole_stall_weight):
# the least TTFT a request must gain whole on a decode engine (seconds: the predictions'
# noise, and more than the transfer a split of an idle fleet pays), and what a second of
# stall in each stream decoding there costs, in seconds of this request's TTFT (the
# module's docstring has the measurements).
FASTER_WHOLE_MARGIN_S = 0.1
FASTER_WHOLE_STALL_WEIGHT = 0.2
# SGLang: the fields its router adds, its default --disaggregation-bootstrap-port
# (server_args.py), and the largest room (random.randint(0, 2**63 - 1) in mini_lb.py).
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
SGLANG_BOOTSTRAP_PORT = 8998
MAX_ROOM = (1 << 63) - 1
_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True, slots=True)
class Split:
    """The decider's answer: split or not, why, the transfer it would cost, and the best
    prefill engine's predicted TTFT (None: its router predicts none, or no engine)."""

    split: bool
    reason: str  # split | short-prefill | transfer-slower | faster-whole | no-prefill-engine
    uncached_tokens: int
    transfer_s: float
    prefill_ttft_s: float | None = None
    kv_bytes_per_token: int = 0  # what the transfer was priced at (0: not priced)
    # The best decode engine's predicted TTFT for the decode leg (the transfer and its
    # wait) and its predicted cost, where a fallback pool's decision needs them: a split
    # request is moved on by both legs (meshd/fallback.py). None: not predicted.
    decode_ttft_s: float | None = None
    decode_cost_usd: float | None = None


def transfer_seconds(prompt_tokens: int, kv_bytes_per_token: int, kv_link_gb_per_s: float) -> float:
    """The prompt's KV over the link: tokens x bytes per token / (GB/s x 1e9)."""
    return prompt_tokens * kv_bytes_per_token / (kv_link_gb_per_s * 1e9)


def decide_split(
    prompt_tokens: int,
    cached_tokens: float | None,
    *,
    min_prefill_tokens: int,
    kv_bytes_per_token: int,
    kv_link_gb_per_s: float,
    recompute_s_per_token: float | None = None,
    prefill_available: bool = True,
    whole_allowed: bool = True,
    prefill_ttft_s: float | None = None,
    decode_cached_tokens: float | None = None,
) -> Split:
    """Split a request of `prompt_tokens` whose best prefill engine holds `cached_tokens` of
    it? (The module's docstring has the rule; `recompute_s_per_token` is its r, None: rule
    3 is not applied.) `whole_allowed` False: the decode engines cannot serve a request
    whole (SGLang's), so every request that can be split is. `prefill_ttft_s`, the best
    prefill engine's predicted TTFT, is carried into the answer. `decode_cached_tokens`:
    the most of the prompt a decode engine holds (its prefix index), whose KV does not
    cross the link (None or 0: the whole prompt's does)."""
    uncached = max(0, prompt_tokens - int(cached_tokens or 0))
    transfer_s = transfer_seconds(
        missing_tokens(prompt_tokens, decode_cached_tokens), kv_bytes_per_token, kv_link_gb_per_s
    )
    b = kv_bytes_per_token
    if not prefill_available:
        return Split(False, "no-prefill-engine", uncached, transfer_s, None, b)
    short = min(uncached, missing_tokens(prompt_tokens, decode_cached_tokens))
    if whole_allowed and short < min_prefill_tokens:
        return Split(False, "short-prefill", uncached, transfer_s, prefill_ttft_s, b)
    if (
        whole_allowed
        and recompute_s_per_token is not None
        and transfer_s >= uncached * recompute_s_per_token
    ):
        return Split(False, "transfer-slower", uncached, transfer_s, prefill_ttft_s, b)
    return Split(True, "split", uncached, transfer_s, prefill_ttft_s, b)


def prefer_whole(
    split: Split,
    whole_ttft_s: float | None,
    margin_s: float | None,
    *,
    streams: float = 0.0,
    stall_weight: float = 0.0,
) -> Split:
    """Rule 4 (the module's docstring): `split`, or, when the request served whole on the
    decode pool (its predicted TTFT `whole_ttft_s` on the engine it would take, where
    `streams` are decoding) would have its first token sooner than split (the prefill's
    predicted TTFT plus the decode leg's, split.prefill_ttft_s + split.decode_ttft_s) by
    more than `margin_s` + `stall_weight` x streams x whole_ttft_s, the same answer
    served whole with reason `faster-whole`. Unchanged when it is not a split, when any
    of the three predictions is missing, or when `margin_s` is None (the rule is off)."""
    if (
        not split.split
        or margin_s is None
        or whole_ttft_s is None
        or split.prefill_ttft_s is None
        or split.decode_ttft_s is None
    ):
        return split
    gain = split.prefill_ttft_s + split.decode_ttft_s - whole_ttft_s
    if gain > margin_s + stall_weight * streams * whole_ttft_s:
        return replace(split, split=False, reason="faster-whole")
    return split


def named_prefill_endpoints(headers: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """The `host:port` prefill endpoints the request's prefill header names (PREFILL_HEADERS,
    the first present; one header line or several, each a comma-separated list), in order,
    without repeats and at most MAX_NAMED_PREFILL; () when it names none."""
    by_name: dict[str, list[str]] = {}
    for name, value in headers:
        lname = name.lower()
        if lname in PREFILL_HEADERS:
            by_name.setdefault(lname, []).append(value)
    for name in PREFILL_HEADERS:
        if name in by_name:
            out: list[str] = []
            for value in by_name[name]:
                for item in value.split(","):
                    item = item.strip()
                    if item and item not in out and len(out) < MAX_NAMED_PREFILL:
                        out.append(item)
            return tuple(out)
    return ()


def missing_tokens(prompt_tokens: int, decode_cached_tokens: float | None) -> int:
    """The prompt tokens whose KV a decode engine holding `decode_cached_tokens` of the
    prompt pulls (vLLM's NIXL connector loads only the blocks its prefix cache lacks:
    NixlConnectorScheduler.get_num_new_matched_tokens counts the prompt less the tokens
    computed locally); at least 1 (the last token's KV always comes)."""
    held = int(decode_cached_tokens or 0)
    return max(1, prompt_tokens - held) if held > 0 else prompt_tokens


def price_decode_routes(
    routes: Sequence[Route],
    decode_cached: Mapping[str, float],
    prompt_tokens: int,
    *,
    kv_bytes_per_token: int,
    kv_link_gb_per_s: float,
    transfer_s: float,
) -> list[Route]:
    """A split request's decode order (Picker.order_decode, each route's predicted TTFT its
    lead, which holds the transfer `transfer_s`, + its wait) with each engine's own
    transfer: the part of the prompt it does not hold (`decode_cached`, by URL) crosses
    the link. Each predicted TTFT takes that engine's transfer instead of `transfer_s`, and
    the order is Picker.order_decode's rule with it: the stream fits in KV first, then by
    transfer + wait + output at the ITL (the choice's score), then by name. Routes without
    a choice (a balancer's) keep their order; with no engine holding any of the prompt
    the order is the one given."""
    if not decode_cached or not routes or any(r.choice is None for r in routes):
        return list(routes)

    def own(route: Route) -> float:
        missing = missing_tokens(prompt_tokens, decode_cached.get(route.url))
        return transfer_seconds(missing, kv_bytes_per_token, kv_link_gb_per_s)

    priced: list[tuple[bool, float, str, Route]] = []
    for r in routes:
        assert r.choice is not None
        t = own(r)
        ttft = r.predicted_ttft_s
        if ttft is not None:
            ttft = max(0.0, ttft - transfer_s + t)
        key = (r.reason != "decode", r.choice.score + t, r.url)
        priced.append((*key, r._replace(predicted_ttft_s=ttft)))
    priced.sort(key=lambda row: row[:3])
    return [row[3] for row in priced]


def prefill_body(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill step's body for the client's request `doc`."""
    body = copy.deepcopy(dict(doc))
    body[KV_PARAMS] = dict(_PREFILL_PARAMS)
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(name, None)
    return body


def transfer_params(answer: Any) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill step's answer (a parsed JSON body), or None
    when it has none (the engine does not run a KV connector: no split is possible)."""
    if not isinstance(answer, dict):
        return None
    params = answer.get(KV_PARAMS)
    if not isinstance(params, dict) or not params:
        return None
    return params


def decode_body(doc: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode step's body: the client's request plus the prefill's transfer params."""
    return {**doc, KV_PARAMS: dict(params)}


def aggregated_body(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The request served whole (a decode step that lost its KV, a continuation after a
    mid-stream failover): without any transfer params or bootstrap fields."""
    return {k: v for k, v in doc.items() if k != KV_PARAMS and k not in BOOTSTRAP_FIELDS}


# ---- what a decode endpoint's proxy did ---------------------------------------------------

# The answer's P/D outcome, which only the proxy in front of the decode engine knows (the
# request was split, or it served it whole, e.g. after a failed prefill step): set by a
# meshd data path for a trusted peer (meshd/relay.py), read by `meshd picker` in its
# response-headers phase (meshd/extproc_picker.py). `split; prefill=<host:port>` (the
# prefill engine whose step or leg answered) or `whole; reason=<why>` (the decider's
# reason, `prefill-failed`, `kv-fetch-failed`, `picker`, ...); its `record` is the access
# log's `pd` (split, whole:<why>).
PD_HEADER = "x-meshd-pd"
# A longer value is not read (a trusted peer's, but bounded all the same).
MAX_PD_HEADER_CHARS = 512


@dataclass(frozen=True, slots=True)
class PdServed:
    """How the decode endpoint's proxy served a request: split (and on which prefill
    engine, `host:port`, when it said), or whole and why."""

    split: bool
    reason: str = ""
    prefill: str | None = None

    @property
    def record(self) -> str:
        """As the access log's `pd` names it: `split` or `whole:<reason>`."""
        return "split" if self.split else f"whole:{self.reason or 'unknown'}"

    def header(self) -> str:
        if self.split:
            return f"split; prefill={self.prefill}" if self.prefill else "split"
        return f"whole; reason={self.reason or 'unknown'}"


def parse_pd_header(value: str) -> PdServed | None:
    """An `x-meshd-pd` value, or None when it is not one (too long, neither split nor
    whole). Parameters it does not know are ignored."""
    if len(value) > MAX_PD_HEADER_CHARS:
        return None
    head, *params = value.split(";")
    kind = head.strip().lower()
    if kind not in ("split", "whole"):
        return None
    found: dict[str, str] = {}
    for param in params:
        key, sep, val = param.partition("=")
        if sep and (key := key.strip().lower()) and key not in found:
            found[key] = val.strip()
    if kind == "split":
        return PdServed(True, "split", found.get("prefill") or None)
    return PdServed(False, found.get("reason") or "unknown")


# ---- SGLang's protocol ---------------------------------------------------------------------


def new_room(rng: random.Random) -> int:
    """A fresh bootstrap room: uniform in [0, 2**63 - 1], as SGLang's routers draw it."""
    return rng.getrandbits(63)


def bootstrap_batch(doc: Mapping[str, Any]) -> int | None:
    """How many rooms a request needs when it is a batch (None: one, as scalars). As
    sgl-model-gateway counts: a chat request with `n` > 1 (one room per choice), a
    completion whose `prompt` is a list of prompts (a list of token ids is one prompt), a
    native /generate request whose `text` is a list or whose `input_ids` is a list of
    lists."""
    text = doc.get("text")
    if text is not None:
        return len(text) if isinstance(text, list) and text else None
    ids = doc.get("input_ids")
    if ids is not None:
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            return len(ids)
        return None
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and not all(_is_int(x) for x in prompt):
        return len(prompt)
    n = doc.get("n")
    if "messages" in doc and isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return n
    return None


def bootstrap_body(
    doc: Mapping[str, Any], host: str, port: int | None, rng: random.Random
) -> dict[str, Any]:
    """The body both legs get under SGLang's protocol: `doc` plus the bootstrap fields for
    the prefill engine at `host`:`port` and fresh rooms drawn from `rng` (one per item of a
    batch, as lists). Any bootstrap fields the client sent are replaced."""
    body = dict(doc)
    n = bootstrap_batch(doc)
    if n is None:
        body.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=new_room(rng))
    else:
        body.update(
            bootstrap_host=[host] * n,
            bootstrap_port=[port] * n,
            bootstrap_room=[new_room(rng) for _ in range(n)],
        )
    return body


# How long a prefill engine that could not say its bootstrap port is not asked again (its
# pairs meanwhile use the configured port, else SGLang's default).
BOOTSTRAP_RETRY_S = 30.0


def bootstrap_port_of(info: Any) -> int | None:
    """The `disaggregation_bootstrap_port` of an SGLang engine's server info (a parsed JSON
    body of /server_info or /get_server_info: its ServerArgs flattened into one object,
    sgl-project/sglang python/sglang/srt/entrypoints/http_server.py, `get_server_info`
    returning `{**dataclasses.asdict(server_args), ...}`), or None when it has none that
    is a port."""
    if not isinstance(info, dict):
        return None
    port = info.get("disaggregation_bootstrap_port")
    if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
        return port
    return None


class BootstrapPorts:
    """The bootstrap ports learnt from SGLang prefill engines, by endpoint URL; and when an
    engine that could not be asked may be asked again (BOOTSTRAP_RETRY_S after). Endpoints
    come from configuration and discovery, not from clients."""

    def __init__(self, retry_s: float = BOOTSTRAP_RETRY_S) -> None:
        self.retry_s = retry_s
        self._ports: dict[str, int] = {}
        self._ask_after: dict[str, float] = {}

    def get(self, url: str, now: float) -> tuple[int | None, bool]:
        """(the port learnt, None when none) and whether to ask the engine now."""
        port = self._ports.get(url)
        if port is not None:
            return port, False
        return None, now >= self._ask_after.get(url, -math.inf)

    def learnt(self, url: str, port: int) -> None:
        self._ports[url] = port
        self._ask_after.pop(url, None)

    def failed(self, url: str, now: float) -> None:
        self._ask_after[url] = now + self.retry_s


def leg_answer(body: bytes, *, sse: bool) -> tuple[str | None, dict[str, Any] | None]:
    """A prefill leg's answer (read whole, then discarded): why it failed (None: it did not)
    and its `usage`, if it sent one. SGLang aborts a request whose KV transfer failed with
    an error: an HTTP error status, or, once a stream began, an SSE event `{"error": ...}`;
    a JSON answer is an error when it has an `error` object or `"object": "error"`."""
    if not sse:
        try:
            doc = json.loads(body)
        except ValueError:
            return "the answer is not JSON", None
        if not isinstance(doc, dict):
            return "the answer is not a JSON object", None
        if doc.get("error") is not None or doc.get("object") == "error":
            return _error_text(doc), None
        usage = doc.get("usage")
        return None, usage if isinstance(usage, dict) else None
    usage = None
    for line in body.splitlines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data.startswith(b"{"):
            continue
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("error") is not None or event.get("object") == "error":
            return _error_text(event), None
        if isinstance(event.get("usage"), dict):
            usage = event["usage"]
    return None, usage


def _error_text(doc: Mapping[str, Any]) -> str:
    err = doc.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"][:200]
    if isinstance(err, str):
        return err[:200]
    msg = doc.get("message")
    return msg[:200] if isinstance(msg, str) else "the engine answered an error"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
