"""Prefill/decode disaggregation between simulated engines: the KV transfer fabric.

The protocol is vLLM's with the NIXL connector, as vLLM's toy proxy speaks it
(vllm-project/vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py;
vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py):

1. Prefill step: the client's request with `kv_transfer_params: {do_remote_decode: true,
   do_remote_prefill: false, remote_*: null}`, `stream: false`, `max_tokens: 1`. The
   engine prefills and samples one token; when that ends length-capped (vLLM's
   FINISHED_LENGTH_CAPPED; an EOS first token pins nothing and answers
   `kv_transfer_params: null`) it keeps the request's blocks pinned for `kv_hold_s`
   (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, default 480 s) and its answer carries, at the top
   level, `kv_transfer_params: {do_remote_prefill: true, do_remote_decode: false,
   remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port,
   tp_size}` (request_finished's dict, NIXL connector version 2).
2. Decode step: the client's request plus those params. The engine claims the KV from the
   named engine (`KVTransferFabric.claim`), pays `tokens x kv_bytes_per_token / link` for
   the prompt tokens its own prefix cache lacks, then decodes; the producer's pinned copy
   is released and stays in its prefix cache as ordinary blocks. A claim that fails
   (engine unknown or gone, request unknown, hold expired or already fetched, other blocks
   or prompt) refuses the step at the door with `FETCH_FAILED_STATUS`, or, with
   `kv_load_failure_policy: recompute`, serves it whole.

SGLang's protocol (`EngineSpec.pd_protocol: sglang`), as its routers speak it
(sgl-project/sglang python/sglang/srt/disaggregation/mini_lb.py; sgl-model-gateway
src/routers/http/pd_router.rs): the router sends the client's request, with
`bootstrap_host`, `bootstrap_port` (the prefill engine's --disaggregation-bootstrap-port,
8998 by default, or null: the engine's own) and a random `bootstrap_room`, to a prefill and
a decode engine at once; the client's answer is the decode engine's.

1. Prefill leg: the engine prefills (one token, whatever `max_tokens` says), keeps the KV
   pinned under the room (`room_key`) for `kv_hold_s`, and answers once a decode engine
   fetched it (SGLang's prefill request ends when its KV transfer is done); if none did
   by then, it answers 500 (SGLang: "Prefill transfer failed"). A streamed leg is
   answered as one SSE body.
2. Decode leg: the engine finds the prefill engine by its bootstrap address, waits for
   the room's KV there (`bootstrap_timeout_s`, SGLANG_DISAGGREGATION_WAITING_TIMEOUT),
   claims it and pays the transfer as a NIXL decode step does, then decodes. When the KV
   never comes, or the address names no engine, the step is refused before any byte with
   `FETCH_FAILED_STATUS` (SGLang aborts it with a 500 "Decode transfer failed"). SGLang's
   prefill and decode engines refuse a request without a room (400, "Disaggregated
   request received without bootstrap room id"); role both ignores the fields.

The fabric is the simulator's NIXL (and SGLang's bootstrap server): an in-process registry
of engines by engine id and by bootstrap address. Real engines (server.py) share the
process-wide `DEFAULT_FABRIC`, each on its own clock; a virtual fleet (virtual.py) has its
own, on the fleet's clock (its engines have no bootstrap address: the virtual fleet does
not speak SGLang's protocol).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from loadtest.engine.core import EngineCore, HeldKV

# A decode step whose KV cannot be fetched. vLLM (kv_load_failure_policy "fail") finishes
# it with finish_reason "error", which its server answers as a bare 500 "Internal server
# error", after a 200 when streamed. The simulator refuses at the door instead, before any
# byte, with a status a router can act on: 410 (the KV it names is gone, for good, from the
# engine the router can reach; no retry on another decode engine can fetch it), and an
# error `type` of its own. The recovery is the request served whole, or a new prefill.
FETCH_FAILED_STATUS: Final = 410
FETCH_FAILED_TYPE: Final = "KVTransferError"
# A step the engine's role does not serve (a decode step on a prefill engine, a prefill
# step on a decode engine): the router sent it to the wrong pool.
ROLE_REFUSED_STATUS: Final = 400

_REASONS: Final = {
    "unknown_engine": "no engine with this remote_engine_id is reachable (stopped, or never was)",
    "unknown_request": "the remote engine holds no KV for this request (restarted, or never had)",
    "expired": "the remote engine released the KV after its hold timeout",
    "already_fetched": "another decode step already fetched this KV",
    "released": "the KV was released when an earlier decode step for it ended",
    "mismatch": "the remote KV is for other blocks or another prompt than this request's",
    "timeout": "no KV came for this room within the decode engine's bootstrap timeout",
}


_ROOM_REASONS: Final = {
    "unknown_engine": "no prefill engine has this bootstrap address",
    "unknown_request": "the prefill engine holds no KV for this room",
    "already_fetched": "another decode leg already fetched this room's KV",
    "mismatch": "the room's KV is for another prompt than this request's",
}


class FetchRefused(Exception):
    """A decode step's KV cannot be fetched; `reason` is one of stats.KV_FETCH_REFUSALS."""

    def __init__(
        self, reason: str, engine_id: str, request_id: str, room: int | None = None
    ) -> None:
        self.reason = reason
        self.engine_id = engine_id
        self.request_id = request_id
        if room is None:
            text = (
                f"KV transfer failed ({reason}): cannot fetch the KV of request "
                f"{request_id!r} from engine {engine_id!r}: {_REASONS.get(reason, reason)}. "
                "Send the request without kv_transfer_params, or prefill it again."
            )
        else:  # SGLang's protocol: the decode leg names a room and a bootstrap address
            why = _ROOM_REASONS.get(reason) or _REASONS.get(reason, reason)
            text = (
                f"KV transfer failed ({reason}): no KV for bootstrap_room {room} from the "
                f"prefill engine {engine_id!r}: {why}. Send both legs again with a new room."
            )
        super().__init__(text)


@dataclass(slots=True)
class _Peer:
    core: EngineCore
    clock: Callable[[], float] | None
    wake: Callable[[], None]


class KVTransferFabric:
    """Engines reachable for KV transfers, by engine id and bootstrap address (see the
    module docstring)."""

    def __init__(self) -> None:
        self._peers: dict[str, _Peer] = {}
        self._addresses: dict[tuple[str, int], str] = {}
        self._watchers: dict[tuple[str, str], list[Callable[[str], None]]] = {}

    def register(
        self,
        engine_id: str,
        core: EngineCore,
        *,
        clock: Callable[[], float] | None = None,
        wake: Callable[[], None] | None = None,
        bootstrap: tuple[str, int] | None = None,
    ) -> None:
        """Make `core`'s pinned KV fetchable under `engine_id`. `clock`: the engine's own
        simulated time (None: the caller's `now` is the engine's too, one shared clock);
        `wake`: tell its driver that blocks came free outside a step; `bootstrap`: the
        (host, port) SGLang's decode steps name it by."""
        self._peers[engine_id] = _Peer(core, clock, wake or _nothing)
        core.hold_events = lambda rid, event: self._tell(engine_id, rid, event)
        if bootstrap is not None:
            self._addresses[bootstrap] = engine_id

    def unregister(self, engine_id: str, core: EngineCore) -> None:
        peer = self._peers.get(engine_id)
        if peer is not None and peer.core is core:
            del self._peers[engine_id]
            core.hold_events = None
            for addr in [a for a, e in self._addresses.items() if e == engine_id]:
                del self._addresses[addr]

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._peers

    def by_bootstrap(self, host: str | None, port: int | None) -> str | None:
        """The engine id at bootstrap address host:port: an exact match, else the one
        engine on that port (the simulated engines share a host, which a router may call
        localhost or 127.0.0.1), or, `port` None, the one engine on that host."""
        found = self._addresses.get((host, port)) if host and port else None
        if found is not None:
            return found
        if port is not None:
            same = {e for (_, p), e in self._addresses.items() if p == port}
        else:
            same = {e for (h, _), e in self._addresses.items() if h == host}
        return same.pop() if len(same) == 1 else None

    def fate(self, engine_id: str, request_id: str) -> str | None:
        """None while `request_id`'s KV is pinned on `engine_id`; else why not
        (EngineCore.hold_fate, or "unknown_engine")."""
        peer = self._peers.get(engine_id)
        if peer is None:
            return "unknown_engine"
        return peer.core.hold_fate(request_id)

    def watch(
        self, engine_id: str, request_id: str, callback: Callable[[str], None]
    ) -> Callable[[], None]:
        """Call `callback(event)` on each event of the hold `request_id` on `engine_id`
        (EngineCore.hold_events); returns the function that stops it."""
        key = (engine_id, request_id)
        self._watchers.setdefault(key, []).append(callback)

        def stop() -> None:
            got = self._watchers.get(key)
            if got is not None and callback in got:
                got.remove(callback)
                if not got:
                    del self._watchers[key]

        return stop

    def watched(self, engine_id: str, request_id: str) -> bool:
        """Is anyone waiting on the hold `request_id` of `engine_id`?"""
        return (engine_id, request_id) in self._watchers

    def _tell(self, engine_id: str, request_id: str, event: str) -> None:
        for callback in list(self._watchers.get((engine_id, request_id), ())):
            callback(event)

    def claim(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Sequence[int] | None,
        prompt_ids: Sequence[int],
        now: float,
    ) -> HeldKV:
        """Claim the KV prefill `request_id` left on `engine_id`, or raise FetchRefused."""
        peer = self._peers.get(engine_id)
        if peer is None:
            raise FetchRefused("unknown_engine", engine_id, request_id)
        t = peer.clock() if peer.clock is not None else now
        got = peer.core.claim_hold(request_id, block_ids, prompt_ids, t)
        peer.wake()
        if isinstance(got, str):
            raise FetchRefused(got, engine_id, request_id)
        return got

    def release(self, engine_id: str, held: HeldKV, now: float, fetched: bool) -> None:
        """Unpin a claimed hold (after its transfer, or its decode step ended without)."""
        peer = self._peers.get(engine_id)
        if peer is None:
            return
        t = peer.clock() if peer.clock is not None else now
        peer.core.release_hold(held, t, fetched=fetched)
        peer.wake()


def _nothing() -> None:
    return None


# The fabric of every real-time engine in the process (one network).
DEFAULT_FABRIC = KVTransferFabric()


def prefill_answer_params(
    block_ids: Sequence[int], engine_id: str, request_id: str, host: str, port: int
) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill step answers with: NIXL's request_finished dict
    (the simulator has no side channel: host and port are the engine's HTTP ones)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(block_ids),
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


def room_key(room: int) -> str:
    """The id an SGLang prefill leg's KV is pinned under on its engine."""
    return f"bootstrap-room-{room}"
