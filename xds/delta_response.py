"""A DeltaDiscoveryResponse as the subscriber applies it, read from its serialized bytes:
its type and nonce, each subscribed resource decoded into an Entry, the names removed, or
the error that makes the subscriber NACK it (xds/client.py).

`read_response` is the compiled twin (xds/_delta_response_c.pyx) when built, else the
reference below (protobuf's parse, then a loop over the resources); MESHD_PURE_PYTHON=1
forces the reference. tests/test_delta_response.py checks that the two agree on arbitrary
responses, well formed or not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from envoy.service.discovery.v3 import discovery_pb2 as pb

from xds.resources import ResourceError

__all__ = [
    "IMPLEMENTATION",
    "DeltaResponse",
    "Entry",
    "Interest",
    "read_response",
    "reference_read",
]


@dataclass(frozen=True, slots=True)
class Entry:
    """A resource as last received: decoded value, its version, when it arrived."""

    name: str
    version: str
    value: Any
    received_at: float


_new = object.__new__


class _EntrySlots:
    """Entry's slot layout without its frozen `__setattr__` (see _entry)."""

    __slots__ = Entry.__slots__


def _entry(name: str, version: str, value: Any, received_at: float) -> Entry:
    """Entry(name, version, value, received_at), built with plain slot stores and then
    given Entry's class (allowed between classes of identical layout): the frozen
    dataclass's __init__ stores through object.__setattr__, several times the cost, once
    per resource applied (loadtest/xds_codec_bench.py, "decode+apply")."""
    e: Any = _new(_EntrySlots)
    e.name = name
    e.version = version
    e.value = value
    e.received_at = received_at
    e.__class__ = Entry
    return e


@dataclass(slots=True)
class Interest:
    """What a subscriber wants of a type: every resource (wildcard) and/or these names."""

    wildcard: bool
    names: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class DeltaResponse:
    """One response as read. `changed` is None for a type not subscribed (ACK it, apply
    nothing); `error` is set (and `changed` empty) when a resource failed to decode: the
    whole response is refused (NACK), as Envoy does."""

    type_url: str
    nonce: str
    changed: dict[str, Entry] | None
    removed: tuple[str, ...]
    error: str | None


Decoders = Mapping[str, Callable[[bytes], Any]]


def reference_read(
    raw: bytes,
    interests: Mapping[str, Interest],
    decoders: Decoders,
    now: float,
    held: Mapping[str, Mapping[str, Entry]] | None = None,
) -> DeltaResponse:
    """The reference: protobuf's parse (a malformed message raises its DecodeError), then
    the subscribed resources decoded in order; the first failure is the error. `held`
    (the subscriber's Entries, by type) changes no answer: the compiled reader takes
    unchanged values from it instead of building them again."""
    resp = pb.DeltaDiscoveryResponse.FromString(raw)
    t, nonce = resp.type_url, resp.nonce
    interest = interests.get(t)
    if interest is None:
        return DeltaResponse(t, nonce, None, (), None)
    decoder = decoders.get(t)
    wildcard, names = interest.wildcard, interest.names
    changed: dict[str, Entry] = {}
    # Per resource, each protobuf field is read once (every read builds a new object).
    for r in resp.resources:
        name = r.name
        if not (wildcard or name in names):
            continue
        any_ = r.resource
        if any_.type_url != t:
            return DeltaResponse(t, nonce, {}, (), f"Any type {any_.type_url!r} in a {t} response")
        try:
            value = any_.value if decoder is None else decoder(any_.value)
        except ResourceError as exc:
            return DeltaResponse(t, nonce, {}, (), f"{name}: {exc}")
        except Exception as exc:  # a decoder bug must not take the subscriber down
            return DeltaResponse(t, nonce, {}, (), f"{name}: {type(exc).__name__}: {exc}")
        changed[name] = _entry(name, r.version, value, now)
    return DeltaResponse(t, nonce, changed, tuple(resp.removed_resources), None)


class ResponseReader(Protocol):
    """reference_read's signature (the compiled twin's too)."""

    def __call__(
        self,
        raw: bytes,
        interests: Mapping[str, Interest],
        decoders: Decoders,
        now: float,
        held: Mapping[str, Mapping[str, Entry]] | None = None,
        /,
    ) -> DeltaResponse: ...


read_response: ResponseReader = reference_read
IMPLEMENTATION = "python (forced by MESHD_PURE_PYTHON)"
if not os.environ.get("MESHD_PURE_PYTHON"):
    try:
        from xds import _delta_response_c  # type: ignore[attr-defined]
    except ImportError:
        IMPLEMENTATION = "python (compiled extension not built)"
    else:
        _delta_response_c.bind(Entry, DeltaResponse, reference_read)
        read_response = _delta_response_c.read_response
        IMPLEMENTATION = "cython"
