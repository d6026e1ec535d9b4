"""One simulated engine's state, whichever clock drives it: its GPU profile, tokenizer,
request parsing, scheduler core (core.py's timing model) and fault state.

The two drivers build their engines here, so they run one implementation: `SimEngine`
(server.py) in real time behind an HTTP socket, `VirtualEngine` (virtual.py) on a virtual
clock with no socket. Neither copies the step model, the request parsing or the way a
fault reaches the GPU; each only supplies time and I/O. Prefill/decode roles and the KV
fetch of a decode step (kv_transfer.py) are decided here too, at the door.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from loadtest.engine import api
from loadtest.engine.config import ROLES, EngineSpec
from loadtest.engine.core import CoreConfig, EngineCore, KVClaim, RequestRejected, SimRequest
from loadtest.engine.faults import FaultSpec, FaultState
from loadtest.engine.kv_transfer import (
    FETCH_FAILED_STATUS,
    FETCH_FAILED_TYPE,
    ROLE_REFUSED_STATUS,
    FetchRefused,
    KVTransferFabric,
    prefill_answer_params,
)
from loadtest.engine.profiles import EngineProfile, get_profile
from loadtest.engine.tokenizer import TokenGenerator, Tokenizer, load_tokenizer

# What a fault still needs from the driver once the replica applied its sans-I/O part.
DriverAction = Literal["restart", "cold_start", "clear"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """An HTTP error answered at the door (no request reaches the core)."""

    status: int
    message: str
    retry_after: float | None


class EngineReplica:
    """See the module docstring. `max_lag_s`: CoreConfig.max_lag_s, in simulated seconds
    (a real-time driver's tolerated lateness; 0 for a virtual clock, which is never late)."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        index: int = 0,
        tokenizer: Tokenizer | None = None,
        max_lag_s: float = 0.0,
    ) -> None:
        spec.validate()
        self.spec = spec
        self.index = index
        self.name = spec.name or f"engine-{index}"
        self.profile: EngineProfile = get_profile(
            spec.gpu, block_size=spec.block_size, kv_blocks=spec.kv_blocks, model=spec.model
        )
        self.tokenizer = tokenizer or load_tokenizer(spec.tokenizer)
        self.generator = TokenGenerator(self.tokenizer, spec.eos_rate)
        self.core = EngineCore(
            CoreConfig(
                profile=self.profile,
                max_model_len=spec.max_model_len,
                max_num_seqs=spec.max_num_seqs,
                max_num_batched_tokens=spec.max_num_batched_tokens,
                enable_prefix_caching=spec.enable_prefix_caching,
                hash_seed=spec.hash_seed,
                max_lag_s=max_lag_s,
                kv_hold_s=spec.kv_hold_s,
                kv_link_bytes_per_s=spec.kv_link_gbps * 1e9,
            ),
            self.generator,
        )
        self.faults = FaultState()
        self.ctx = api.ApiContext(spec.model, self.tokenizer, spec.max_model_len, spec.seed)
        self.role = spec.role
        self.kv_role = ROLES[spec.role]
        self.kv_engine_id = spec.kv_engine_id or str(uuid.uuid4())
        self.fabric: KVTransferFabric | None = None

    # ---- disaggregation ------------------------------------------------------------
    def connect(
        self,
        fabric: KVTransferFabric,
        *,
        clock: Callable[[], float] | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        """Join `fabric`: decode steps anywhere on it can fetch this engine's pinned KV,
        and this engine's decode steps fetch from its engines."""
        self.fabric = fabric
        fabric.register(self.kv_engine_id, self.core, clock=clock, wake=wake)

    def disconnect(self) -> None:
        if self.fabric is not None:
            self.fabric.unregister(self.kv_engine_id, self.core)

    def submit(self, parsed: api.ParsedRequest, request_id: str, now: float) -> SimRequest:
        """The request into the scheduler at `now`, or api.ApiError (a step the role does
        not serve, a KV fetch refused) or core.RequestRejected."""
        req = self.new_request(parsed, request_id)
        kv = parsed.kv_transfer
        if kv is not None and kv.do_remote_decode:
            if self.role == "decode":
                raise self._role_refusal("prefill", "do_remote_decode")
            req.kv_hold = True
        elif kv is not None and kv.do_remote_prefill:
            if self.role == "prefill":
                raise self._role_refusal("decode", "do_remote_prefill")
            self._claim(req, kv, now)
        try:
            self.core.submit(req, now)
        except RequestRejected:
            claim = req.remote
            if claim is not None:
                claim.done = True
                claim.release(now, False)
            raise
        return req

    def _role_refusal(self, step: str, flag: str) -> api.ApiError:
        return api.ApiError(
            ROLE_REFUSED_STATUS,
            f"This engine's kv_role is {self.kv_role} (role {self.role}): it does not serve "
            f"{step} steps (kv_transfer_params.{flag}). Send it to a {step} or both engine.",
            api.KV_PARAMS,
        )

    def _claim(self, req: SimRequest, kv: api.KVTransferParams, now: float) -> None:
        engine_id = kv.remote_engine_id or ""
        # NIXL connector version 1 had no remote_request_id: both steps share an id.
        rid = kv.remote_request_id or req.request_id
        try:
            if self.fabric is None:
                raise FetchRefused("unknown_engine", engine_id, rid)
            held = self.fabric.claim(engine_id, rid, kv.remote_block_ids, req.prompt_ids, now)
        except FetchRefused as exc:
            refused = self.core.stats.kv_fetch_refused
            refused[exc.reason] = refused.get(exc.reason, 0) + 1
            if self.spec.kv_load_failure_policy == "recompute":
                return  # served whole: the prompt is computed here
            raise api.ApiError(
                FETCH_FAILED_STATUS, str(exc), api.KV_PARAMS, err_type=FETCH_FAILED_TYPE
            ) from None
        fabric = self.fabric

        def release(t: float, fetched: bool) -> None:
            fabric.release(engine_id, held, t, fetched)

        req.remote = KVClaim(engine_id, rid, release)

    def transfer_params(self, req: SimRequest, host: str, port: int) -> dict[str, Any] | None:
        """A finished prefill step's `kv_transfer_params` (None: nothing was pinned)."""
        if req.held_block_ids is None:
            return None
        return prefill_answer_params(
            req.held_block_ids, self.kv_engine_id, req.request_id, host, port
        )

    def parse(self, kind: api.RequestKind, body: Any) -> api.ParsedRequest:
        """A decoded JSON body -> ParsedRequest, or api.ApiError (400/404) as vLLM answers."""
        return (api.parse_chat if kind == "chat" else api.parse_completion)(body, self.ctx)

    @staticmethod
    def new_request(parsed: api.ParsedRequest, request_id: str) -> SimRequest:
        return SimRequest(
            request_id,
            parsed.prompt_ids,
            parsed.max_tokens,
            seed=parsed.seed,
            ignore_eos=parsed.ignore_eos,
            stop=parsed.stop,
            min_tokens=parsed.min_tokens,
        )

    def apply_fault(self, fault: FaultSpec, now: float) -> DriverAction | None:
        """Apply what of `fault` is state (request faults, slowdown, hang, clear); returns
        what the driver still has to do with its connections and clock, if anything."""
        kind = fault.kind
        core = self.core
        if kind in ("status_burst", "crash_after_tokens"):
            self.faults.add_request_fault(fault)
        elif kind == "slowdown":
            core.set_slowdown(fault.factor)
        elif kind == "hang":
            core.pause(now, now + fault.seconds if fault.seconds is not None else float("inf"))
        elif kind == "restart":
            return "restart"
        elif kind == "cold_start":
            return "cold_start"
        elif kind == "clear":
            self.faults.clear()
            core.set_slowdown(1.0)
            core.resume(now)
            return "clear"
        return None

    def refusal(self, now: float, *, generation: bool) -> Refusal | None:
        """The error an arriving request gets before it reaches the scheduler, if any:
        503 while the weights load, else (generation paths only) an injected status burst."""
        if self.faults.loading(now):
            return Refusal(503, "The engine is loading its weights.", None)
        if generation:
            rej = self.faults.take_rejection()
            if rej is not None:
                return Refusal(rej.status, f"Injected fault: HTTP {rej.status}.", rej.retry_after)
        return None

    def usage(self, req: SimRequest) -> dict[str, Any]:
        return api.usage(req.num_prompt_tokens, req.num_output_tokens, req.cached_tokens)
