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
    room_key,
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

    # ---- /metrics -------------------------------------------------------------------
    def metrics_text(self, now: float, time_scale: float = 1.0) -> str:
        """The engine's /metrics page at simulated time `now` (vLLM's names and shapes): what
        the HTTP server answers, and what the virtual clock's sidecar probe reads."""
        from loadtest.engine.stats import render_metrics

        core = self.core
        spec = self.spec
        cache_config = {
            "block_size": str(self.profile.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(spec.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "num_gpu_blocks": str(core.pool.num_blocks),
            "num_gpu_blocks_override": str(spec.kv_blocks),
            "prefix_caching_hash_algo": "sha256_cbor",
        }
        extra = {
            "gpu": self.profile.gpu,
            "price_per_gpu_hour": str(self.profile.price_per_gpu_hour),
            "time_scale": str(time_scale),
            "name": self.name,
            "kv_role": self.kv_role,
            "kv_engine_id": self.kv_engine_id,
        }
        return render_metrics(
            core.stats,
            model_name=spec.model,
            engine=str(0),
            running=core.num_running,
            waiting=core.num_waiting,
            waiting_capacity=core.num_waiting,
            kv_cache_usage=core.kv_usage(),
            cache_config=cache_config,
            extra_info=extra,
            kv_held_requests=core.num_held_requests,
            kv_held_blocks=core.num_held_blocks,
            busy_seconds=core.busy_time_at(now),
        )

    # ---- disaggregation ------------------------------------------------------------
    def connect(
        self,
        fabric: KVTransferFabric,
        *,
        clock: Callable[[], float] | None = None,
        wake: Callable[[], None] | None = None,
        bootstrap: tuple[str, int] | None = None,
    ) -> None:
        """Join `fabric`: decode steps anywhere on it can fetch this engine's pinned KV,
        and this engine's decode steps fetch from its engines. `bootstrap`: the (host,
        port) SGLang's decode steps name this engine by (pd_protocol sglang)."""
        self.fabric = fabric
        if self.spec.pd_protocol != "sglang":
            bootstrap = None
        fabric.register(self.kv_engine_id, self.core, clock=clock, wake=wake, bootstrap=bootstrap)

    def disconnect(self) -> None:
        if self.fabric is not None:
            self.fabric.unregister(self.kv_engine_id, self.core)

    def submit(self, parsed: api.ParsedRequest, request_id: str, now: float) -> SimRequest:
        """The request into the scheduler at `now`, or api.ApiError (a step the role does
        not serve, a KV fetch refused) or core.RequestRejected."""
        req = self.new_request(parsed, request_id)
        kv = parsed.kv_transfer
        if self.sglang_leg:
            self._sglang_leg(req, parsed, now)
        elif self.spec.pd_protocol == "sglang":
            pass  # role both (SGLang's null mode): served whole, whatever the fields say
        elif kv is not None and kv.do_remote_decode:
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
        self._claim_from(req, engine_id, rid, kv.remote_block_ids, now, api.KV_PARAMS)

    def _claim_from(
        self,
        req: SimRequest,
        engine_id: str,
        rid: str,
        block_ids: tuple[int, ...] | None,
        now: float,
        param: str,
        *,
        room: int | None = None,
    ) -> None:
        try:
            if self.fabric is None:
                raise FetchRefused("unknown_engine", engine_id, rid)
            held = self.fabric.claim(engine_id, rid, block_ids, req.prompt_ids, now)
        except FetchRefused as exc:
            if room is not None:
                exc = FetchRefused(exc.reason, exc.engine_id, exc.request_id, room)
            if self.spec.kv_load_failure_policy == "recompute":
                self._count_refusal(exc.reason)
                return  # served whole: the prompt is computed here
            raise self.fetch_refused(exc, param) from None
        fabric = self.fabric

        def release(t: float, fetched: bool) -> None:
            fabric.release(engine_id, held, t, fetched)

        req.remote = KVClaim(engine_id, rid, release)

    def _count_refusal(self, reason: str) -> None:
        refused = self.core.stats.kv_fetch_refused
        refused[reason] = refused.get(reason, 0) + 1

    def fetch_refused(self, exc: FetchRefused, param: str = api.KV_PARAMS) -> api.ApiError:
        """A decode step whose KV cannot be fetched: counted, and its 410 KVTransferError;
        or (kv_fetch_failure_style "vllm") vLLM's bare 500, after a 200 when streamed."""
        self._count_refusal(exc.reason)
        if self.spec.kv_fetch_failure_style == "vllm":
            return api.ApiError(
                500, "Internal server error", err_type="InternalServerError", in_stream=True
            )
        return api.ApiError(FETCH_FAILED_STATUS, str(exc), param, err_type=FETCH_FAILED_TYPE)

    # ---- SGLang's protocol (kv_transfer.py) ------------------------------------------
    @property
    def sglang_leg(self) -> bool:
        """Does this engine serve SGLang legs (pd_protocol sglang, role prefill or decode)?"""
        return self.spec.pd_protocol == "sglang" and self.role != "both"

    def _sglang_leg(self, req: SimRequest, parsed: api.ParsedRequest, now: float) -> None:
        bs = parsed.bootstrap
        if parsed.kv_transfer is not None:
            raise api.ApiError(
                400,
                f"{api.KV_PARAMS}: this engine speaks SGLang's protocol (pd_protocol sglang); "
                "send bootstrap_host, bootstrap_port and bootstrap_room instead",
                api.KV_PARAMS,
            )
        if bs is None:
            # SGLang's words, from its tokenizer manager.
            raise api.ApiError(
                400,
                "Disaggregated request received without bootstrap room id",
                "bootstrap_room",
            )
        key = room_key(bs.room)
        if self.role == "prefill":
            # A prefill leg computes the prompt and one token, whatever max_tokens says,
            # and its KV is sent whatever that token is.
            req.request_id = key
            req.kv_hold = True
            req.max_tokens = 1
            req.min_tokens = 0
            req.ignore_eos = True
            return
        engine_id = self.room_engine(parsed)
        self._claim_from(req, engine_id, key, None, now, "bootstrap_room", room=bs.room)

    def room_engine(self, parsed: api.ParsedRequest) -> str:
        """The engine id of a decode leg's prefill engine, by its bootstrap address (port
        null: this engine's own bootstrap_port, as SGLang fills it in); a 410 when no
        engine is there."""
        bs = parsed.bootstrap
        assert bs is not None
        port = bs.port if bs.port is not None else self.spec.bootstrap_port
        found = self.fabric.by_bootstrap(bs.host, port) if self.fabric is not None else None
        if found is None:
            where = f"{bs.host}:{port if port is not None else '(default)'}"
            exc = FetchRefused("unknown_engine", where, room_key(bs.room), bs.room)
            raise self.fetch_refused(exc, "bootstrap_host")
        return found

    def room_to_await(self, parsed: api.ParsedRequest) -> tuple[str, str] | None:
        """A decode leg whose room's KV is not pinned yet: (engine id, hold id) to wait on
        before `submit`. None: submit now (not a decode leg, or the KV is there, or gone:
        `submit` says why). Raises api.ApiError for an unknown bootstrap address."""
        if not self.sglang_leg or self.role != "decode" or parsed.bootstrap is None:
            return None
        if parsed.kv_transfer is not None:
            return None  # submit refuses it
        engine_id = self.room_engine(parsed)
        key = room_key(parsed.bootstrap.room)
        assert self.fabric is not None
        return (engine_id, key) if self.fabric.fate(engine_id, key) == "unknown_request" else None

    def room_timeout(self, parsed: api.ParsedRequest, engine_id: str) -> api.ApiError:
        """A decode leg whose room's KV never came: counted, and its 410."""
        assert parsed.bootstrap is not None
        room = parsed.bootstrap.room
        exc = FetchRefused("timeout", engine_id, room_key(room), room)
        return self.fetch_refused(exc, "bootstrap_room")

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
