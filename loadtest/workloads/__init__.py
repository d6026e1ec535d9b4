"""Workloads for the benchmark runner: trace replay and seeded generators of planned requests.

Pure planning, no I/O beyond reading trace files: each entry point returns a list of
frozen `PlannedRequest` values sorted by arrival time; `render` is the runner's contract
for steps that extend the previous answer.
"""

from loadtest.workloads.arrivals import Burst, arrival_times, bursty, poisson
from loadtest.workloads.generators import (
    DEFAULT_BLOCK_TOKENS,
    agentic,
    mix,
    multi_turn,
    shared_prefix,
)
from loadtest.workloads.registry import WORKLOADS, azure_code, azure_conv, demo, mooncake
from loadtest.workloads.request import (
    Kind,
    Message,
    PlannedRequest,
    Role,
    extend,
    extend_messages,
    render,
)
from loadtest.workloads.stats import (
    context_tokens_estimate,
    describe,
    quantile,
    round_robin_bound,
    upper_bound_hit_rate,
)
from loadtest.workloads.tenants import (
    DEFAULT_TENANTS,
    DEMO_TENANTS,
    Tenant,
    assign_tenants,
    parse_tenants,
)
from loadtest.workloads.text import (
    VOCABULARY,
    block_text,
    block_words,
    count_tokens,
    synthetic_block_id,
)
from loadtest.workloads.traces import (
    AZURE_CODE,
    AZURE_CONV,
    MOONCAKE_SYNTHETIC,
    TRACES_ENV,
    TraceFormatError,
    parse_azure,
    parse_mooncake,
    read_azure,
    read_mooncake,
    traces_dir,
)

__all__ = [
    "AZURE_CODE",
    "AZURE_CONV",
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_TENANTS",
    "DEMO_TENANTS",
    "MOONCAKE_SYNTHETIC",
    "TRACES_ENV",
    "VOCABULARY",
    "WORKLOADS",
    "Burst",
    "Kind",
    "Message",
    "PlannedRequest",
    "Role",
    "Tenant",
    "TraceFormatError",
    "agentic",
    "arrival_times",
    "assign_tenants",
    "azure_code",
    "azure_conv",
    "block_text",
    "block_words",
    "bursty",
    "context_tokens_estimate",
    "count_tokens",
    "demo",
    "describe",
    "extend",
    "extend_messages",
    "mix",
    "mooncake",
    "multi_turn",
    "parse_azure",
    "parse_mooncake",
    "parse_tenants",
    "poisson",
    "quantile",
    "read_azure",
    "read_mooncake",
    "render",
    "round_robin_bound",
    "shared_prefix",
    "synthetic_block_id",
    "traces_dir",
    "upper_bound_hit_rate",
]
