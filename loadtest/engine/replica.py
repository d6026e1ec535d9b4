"""One simulated engine's state, whichever clock drives it: its GPU profile, tokenizer,
request parsing, scheduler core (core.py's timing model) and fault state.

The two drivers build their engines here, so they run one implementation: `SimEngine`
(server.py) in real time behind an HTTP socket, `VirtualEngine` (virtual.py) on a virtual
clock with no socket. Neither copies the step model, the request parsing or the way a
fault reaches the GPU; each only supplies time and I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from loadtest.engine import api
from loadtest.engine.config import EngineSpec
from loadtest.engine.core import CoreConfig, EngineCore, SimRequest
from loadtest.engine.faults import FaultSpec, FaultState
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
            ),
            self.generator,
        )
        self.faults = FaultState()
        self.ctx = api.ApiContext(spec.model, self.tokenizer, spec.max_model_len, spec.seed)

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
