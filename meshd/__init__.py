"""meshd: a sidecar proxy and service-mesh filter for LLM inference traffic."""

__version__ = "0.1.0"
