"""Engine simulator configuration: one `EngineSpec` per engine, and fleet config files.

A config file (YAML or JSON) lists engines; `count` repeats one on consecutive ports and
`defaults` applies to all::

    host: 127.0.0.1
    defaults: {model: meta-llama/Llama-3.1-8B-Instruct, time_scale: 1.0}
    engines:
      - {gpu: H100, port: 8001, kv_events_endpoint: "tcp://*:5557"}
      - {gpu: A100, port: 8002, count: 3}
      - gpu: H200
        port: 8005
        faults: [{kind: slowdown, factor: 4, at: 30}]
      - {gpu: H100, port: 8006, role: prefill, kv_hold_s: 60}
      - {gpu: H100, port: 8007, role: decode, kv_link_gbps: 25}
      - {gpu: H100, port: 8008, role: prefill, pd_protocol: sglang}
      - {gpu: H100, port: 8009, role: decode, pd_protocol: sglang}

Keys are EngineSpec's field names; unknown keys are an error that names them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from loadtest.engine.faults import FaultError, FaultSpec, parse_fault
from loadtest.engine.kv_events import offset_endpoint
from loadtest.engine.profiles import GPUS

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Prefill/decode roles (kv_transfer.py has the protocol) and vLLM's kv_role for each.
ROLES = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
# How a decode step whose KV cannot be fetched is refused (kv_load_failure_policy "fail"):
# "410", the simulator's own (410 KVTransferError, before any byte), or "vllm", as real
# vLLM answers it (500 InternalServerError; streamed, HTTP 200 then that error as an event
# and [DONE]: notes/real-vllm-pd-on-cpu.md).
KV_FETCH_FAILURE_STYLES = ("410", "vllm")
# The disaggregated-serving protocols (kv_transfer.py): vLLM's NIXL kv_transfer_params, and
# SGLang's bootstrap host/port/room.
PD_PROTOCOLS = ("vllm-nixl", "sglang")


class ConfigError(ValueError):
    """A bad engine or fleet configuration; the message names the offending key."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Everything that makes one simulated engine (all times in simulated seconds)."""

    gpu: str = "H100"
    model: str = DEFAULT_MODEL
    port: int = 0
    name: str | None = None
    seed: int = 0
    kv_blocks: int | None = None
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    # Simulated seconds per wall second: 10 runs ten times faster than a real GPU.
    time_scale: float = 1.0
    cold_start_s: float = 0.0
    cold_start_mode: str = "refuse"
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_format: str = "map"
    tokenizer: str | None = None
    hash_seed: str = "0"
    eos_rate: float = 0.0
    faults: tuple[FaultSpec, ...] = field(default_factory=tuple)
    # Prefill/decode disaggregation (kv_transfer.py): which steps the engine serves
    # (ROLES), how long a prefill step's KV stays pinned for its decode step (vLLM's
    # VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s), the KV link's bandwidth in gigaBYTES per
    # second (50: one 400 Gb/s RDMA NIC per GPU, as on a DGX H100), what a decode step
    # whose KV cannot be fetched gets (vLLM's kv_load_failure_policy: "fail", its
    # default, or "recompute"), and the engine id its prefill answers name (vLLM's
    # kv_transfer_config.engine_id; None: a fresh uuid, as vLLM picks).
    role: str = "both"
    kv_hold_s: float = 480.0
    kv_link_gbps: float = 50.0
    kv_load_failure_policy: str = "fail"
    kv_fetch_failure_style: str = "410"
    kv_engine_id: str | None = None
    # SGLang's protocol (kv_transfer.py): which protocol the engine speaks (PD_PROTOCOLS),
    # the bootstrap port its prefill role is reached at (SGLang's
    # --disaggregation-bootstrap-port, 8998 there; None here: the engine's HTTP port, as
    # simulated engines share a host and need no second socket), and how long a decode
    # step waits for its room's KV before it is refused
    # (SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s).
    pd_protocol: str = "vllm-nixl"
    bootstrap_port: int | None = None
    bootstrap_timeout_s: float = 300.0

    def validate(self) -> EngineSpec:
        if self.gpu.upper() not in GPUS:
            raise ConfigError(f"gpu: unknown GPU {self.gpu!r}; known: {', '.join(GPUS)}")
        if not 0 <= self.port < 65536:
            raise ConfigError("port: must be 0-65535")
        if self.block_size < 1 or self.max_model_len < 2:
            raise ConfigError("block_size and max_model_len must be positive")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ConfigError("kv_blocks: must be positive")
        if self.time_scale <= 0:
            raise ConfigError("time_scale: must be positive")
        if self.cold_start_s < 0:
            raise ConfigError("cold_start_s: must be >= 0")
        if self.cold_start_mode not in ("refuse", "unavailable"):
            raise ConfigError("cold_start_mode: 'refuse' or 'unavailable'")
        if self.kv_events_format not in ("map", "array"):
            raise ConfigError("kv_events_format: 'map' or 'array'")
        if not 0 <= self.eos_rate < 1:
            raise ConfigError("eos_rate: must be in [0, 1)")
        if self.role not in ROLES:
            raise ConfigError(f"role: one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.kv_hold_s > 0:
            raise ConfigError("kv_hold_s: must be positive")
        if not self.kv_link_gbps > 0:
            raise ConfigError("kv_link_gbps: must be positive")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ConfigError("kv_load_failure_policy: 'fail' or 'recompute'")
        if self.kv_fetch_failure_style not in KV_FETCH_FAILURE_STYLES:
            raise ConfigError("kv_fetch_failure_style: '410' or 'vllm'")
        if self.kv_engine_id is not None and not self.kv_engine_id:
            raise ConfigError("kv_engine_id: must not be empty")
        if self.pd_protocol not in PD_PROTOCOLS:
            raise ConfigError(
                f"pd_protocol: one of {', '.join(PD_PROTOCOLS)}, got {self.pd_protocol!r}"
            )
        if self.bootstrap_port is not None and not 0 < self.bootstrap_port < 65536:
            raise ConfigError("bootstrap_port: must be 1-65535")
        if not self.bootstrap_timeout_s > 0:
            raise ConfigError("bootstrap_timeout_s: must be positive")
        return self

    def for_index(self, offset: int) -> EngineSpec:
        """The spec of the `offset`-th copy: consecutive ports and KV-event ports."""
        if offset == 0:
            return self
        return replace(
            self,
            port=self.port + offset if self.port else 0,
            name=f"{self.name}-{offset}" if self.name else None,
            kv_engine_id=f"{self.kv_engine_id}-{offset}" if self.kv_engine_id else None,
            bootstrap_port=self.bootstrap_port + offset if self.bootstrap_port else None,
            kv_events_endpoint=offset_endpoint(self.kv_events_endpoint, offset),
            kv_events_replay_endpoint=offset_endpoint(self.kv_events_replay_endpoint, offset),
        )


_FIELDS = {f.name for f in fields(EngineSpec)}


def spec_from_dict(doc: Mapping[str, Any], where: str = "engine") -> EngineSpec:
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(unknown)}")
    kwargs = dict(doc)
    if "faults" in kwargs:
        raw = kwargs["faults"] or []
        if not isinstance(raw, list):
            raise ConfigError(f"{where}.faults: must be a list")
        try:
            kwargs["faults"] = tuple(parse_fault(f) for f in raw)
        except FaultError as exc:
            raise ConfigError(f"{where}.faults: {exc}") from None
    try:
        spec = EngineSpec(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    try:
        return spec.validate()
    except ConfigError as exc:
        raise ConfigError(f"{where}.{exc}") from None


@dataclass(frozen=True, slots=True)
class FleetConfig:
    host: str
    engines: tuple[EngineSpec, ...]


def fleet_from_dict(doc: Any) -> FleetConfig:
    if not isinstance(doc, Mapping):
        raise ConfigError("the config must be a mapping with an 'engines' list")
    unknown = sorted(set(doc) - {"host", "defaults", "engines"})
    if unknown:
        raise ConfigError(f"unknown top-level keys {', '.join(unknown)}")
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise ConfigError("defaults: must be a mapping")
    raw = doc.get("engines")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("engines: must be a non-empty list")
    specs: list[EngineSpec] = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"engines[{i}]: must be a mapping")
        merged = {**defaults, **entry}
        count = merged.pop("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"engines[{i}].count: must be a positive integer")
        spec = spec_from_dict(merged, f"engines[{i}]")
        specs.extend(spec.for_index(k) for k in range(count))
    return FleetConfig(host=str(doc.get("host", "127.0.0.1")), engines=tuple(specs))


def load_fleet_config(path: str | Path) -> FleetConfig:
    text = Path(path).read_text()
    doc = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    return fleet_from_dict(doc)


def mixed_fleet(
    n: int,
    gpus: Sequence[str],
    *,
    base: EngineSpec | None = None,
    port: int = 0,
    roles: Sequence[str] | None = None,
) -> tuple[EngineSpec, ...]:
    """n engines cycling through `gpus` (H100, A100, ...) and `roles` (prefill, decode,
    both; default the base's), on consecutive ports from `port`."""
    if n < 1 or not gpus:
        raise ConfigError("a fleet needs n >= 1 and at least one GPU")
    if roles is not None:
        bad = [r for r in roles if r not in ROLES]
        if not roles or bad:
            raise ConfigError(f"roles: each one of {', '.join(ROLES)}, got {list(roles)}")
    template = base or EngineSpec()
    out = []
    for i in range(n):
        spec = replace(template, gpu=gpus[i % len(gpus)], port=port)
        if roles:
            spec = replace(spec, role=roles[i % len(roles)])
        out.append(spec.for_index(i).validate())
    return tuple(out)
