"""Tenant mixes: names with weights (share of requests or chains) and priorities.

Generators draw a tenant per independent request or per chain (a whole session or task
belongs to one tenant); `assign_tenants` does the same for traces, which carry none.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.workloads.request import PlannedRequest

# Tenant names travel in HTTP headers and metric labels.
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant: name, relative weight (> 0) and priority 0..9 (higher more important)."""

    name: str
    weight: float = 1.0
    priority: int = 5

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"tenant name {self.name!r} must match {_NAME.pattern}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"tenant {self.name}: weight must be finite and > 0")
        if not 0 <= self.priority <= 9:
            raise ValueError(f"tenant {self.name}: priority must be 0..9, got {self.priority}")


DEFAULT_TENANTS: tuple[Tenant, ...] = (Tenant("default", 1.0, 5),)
DEMO_TENANTS: tuple[Tenant, ...] = (
    Tenant("gold", 1.0, 9),
    Tenant("silver", 2.0, 5),
    Tenant("bronze", 3.0, 1),
)


def check_tenants(tenants: Sequence[Tenant]) -> tuple[Tenant, ...]:
    """The tenants as a tuple, after checking there is at least one and names are unique."""
    result = tuple(tenants)
    if not result:
        raise ValueError("a tenant mix needs at least one tenant")
    names = [t.name for t in result]
    if len(set(names)) != len(names):
        raise ValueError(f"tenant names must be unique: {names}")
    return result


def parse_tenants(spec: str) -> tuple[Tenant, ...]:
    """Parse "name:weight:priority,..." (weight and priority optional), e.g. "gold:1:9,free:4:1"."""
    tenants: list[Tenant] = []
    for item in spec.split(","):
        fields = item.strip().split(":")
        if not fields[0] or len(fields) > 3:
            raise ValueError(f"tenant spec {item!r}: expected name[:weight[:priority]]")
        try:
            weight = float(fields[1]) if len(fields) > 1 else 1.0
            priority = int(fields[2]) if len(fields) > 2 else 5
        except ValueError:
            raise ValueError(
                f"tenant spec {item!r}: weight is a number, priority an integer"
            ) from None
        tenants.append(Tenant(fields[0], weight, priority))
    return check_tenants(tenants)


def pick_tenant(rng: random.Random, tenants: Sequence[Tenant]) -> Tenant:
    """One tenant drawn by weight."""
    if len(tenants) == 1:
        return tenants[0]
    return rng.choices(tenants, weights=[t.weight for t in tenants])[0]


def assign_tenants(
    requests: Sequence[PlannedRequest], tenants: Sequence[Tenant], seed: int = 0
) -> list[PlannedRequest]:
    """Copies of `requests` with tenants drawn by weight: one per chain, else per request."""
    mix = check_tenants(tenants)
    rng = random.Random(seed)
    per_chain: dict[str, Tenant] = {}
    out: list[PlannedRequest] = []
    for r in requests:
        chain = r.chain_id
        if chain is None:
            tenant = pick_tenant(rng, mix)
        else:
            tenant = per_chain.get(chain) or per_chain.setdefault(chain, pick_tenant(rng, mix))
        out.append(dataclasses.replace(r, tenant=tenant.name, priority=tenant.priority))
    return out
