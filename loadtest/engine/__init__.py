"""A vLLM-compatible engine simulator: vLLM's HTTP API, metrics and KV events over a
sans-I/O continuous-batching core with per-GPU timing profiles (see core.py, server.py),
and the same engines on a virtual clock (virtual.py)."""

from loadtest.engine.config import (
    DEFAULT_MODEL,
    ConfigError,
    EngineSpec,
    FleetConfig,
    fleet_from_dict,
    load_fleet_config,
    mixed_fleet,
)
from loadtest.engine.core import (
    CoreConfig,
    EngineCore,
    RequestRejected,
    SimRequest,
    StepResult,
    run_until_idle,
)
from loadtest.engine.faults import FaultError, FaultSpec, parse_fault
from loadtest.engine.fleet import EngineFleet
from loadtest.engine.kv_transfer import DEFAULT_FABRIC, KVTransferFabric
from loadtest.engine.profiles import GPUS, EngineProfile, get_profile
from loadtest.engine.replica import EngineReplica
from loadtest.engine.server import SimEngine
from loadtest.engine.tokenizer import TokenGenerator, WordTokenizer, render_chat
from loadtest.engine.virtual import VirtualEngine, VirtualFleet

__all__ = [
    "DEFAULT_FABRIC",
    "DEFAULT_MODEL",
    "GPUS",
    "ConfigError",
    "CoreConfig",
    "EngineCore",
    "EngineFleet",
    "EngineProfile",
    "EngineReplica",
    "EngineSpec",
    "FaultError",
    "FaultSpec",
    "FleetConfig",
    "KVTransferFabric",
    "RequestRejected",
    "SimEngine",
    "SimRequest",
    "StepResult",
    "TokenGenerator",
    "VirtualEngine",
    "VirtualFleet",
    "WordTokenizer",
    "fleet_from_dict",
    "get_profile",
    "load_fleet_config",
    "mixed_fleet",
    "parse_fault",
    "render_chat",
    "run_until_idle",
]
