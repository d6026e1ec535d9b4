"""The control plane's state, apart from its transport: versioned resources keyed by type URL
and name, after go-control-plane's snapshot cache (envoyproxy/go-control-plane,
pkg/cache/v3). Pure: no asyncio, no sockets; watchers get a synchronous callback.

Versions: each resource's version is a hash of its serialized body, so two control-plane
replicas holding the same bytes agree on it and a client resuming on another replica gets
only what really differs; each type's version is a counter that grows by one per change
(state-of-the-world `version_info`, delta `system_version_info`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["Resource", "SnapshotCache", "Watcher", "resource_version"]

# (type_url, names changed or removed). Called synchronously from the mutating call, on the
# caller's thread: it must only record the change and return (the server's watchers mark
# names dirty and wake the stream's writer).
Watcher = Callable[[str, frozenset[str]], None]


def resource_version(body: bytes) -> str:
    """A resource's version: 64 bits of BLAKE2b over its serialized body (hex)."""
    return hashlib.blake2b(body, digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class Resource:
    """One resource: `body` is the serialized payload that travels as `Any.value`."""

    type_url: str
    name: str
    body: bytes
    version: str


class SnapshotCache:
    """Resources by type URL and name, with per-type and per-resource versions."""

    def __init__(self) -> None:
        self._resources: dict[str, dict[str, Resource]] = {}
        self._type_versions: dict[str, int] = {}
        self._watchers: list[Watcher] = []

    # -- reads ----------------------------------------------------------------------------

    def get(self, type_url: str, name: str) -> Resource | None:
        return self._resources.get(type_url, {}).get(name)

    def resources(self, type_url: str) -> Mapping[str, Resource]:
        """A read-only live view of one type's resources."""
        return MappingProxyType(self._resources.setdefault(type_url, {}))

    def type_version(self, type_url: str) -> int:
        """0 before the type's first change, then +1 per change (set or remove) batch."""
        return self._type_versions.get(type_url, 0)

    def type_urls(self) -> list[str]:
        return list(self._resources)

    # -- writes ---------------------------------------------------------------------------

    def set(self, type_url: str, name: str, body: bytes) -> bool:
        """Store one resource; returns whether it changed (same bytes: no version bump)."""
        return bool(self.update(type_url, {name: body}))

    def remove(self, type_url: str, name: str) -> bool:
        return bool(self.update(type_url, {}, removed=(name,)))

    def update(
        self,
        type_url: str,
        upserts: Mapping[str, bytes],
        removed: Iterable[str] = (),
    ) -> frozenset[str]:
        """Apply a batch atomically: one type-version bump and one notification for all of
        it. Returns the names that actually changed."""
        table = self._resources.setdefault(type_url, {})
        changed: set[str] = set()
        for name, body in upserts.items():
            version = resource_version(body)
            old = table.get(name)
            if old is not None and old.version == version:
                continue
            table[name] = Resource(type_url, name, body, version)
            changed.add(name)
        for name in removed:
            if table.pop(name, None) is not None:
                changed.add(name)
        if not changed:
            return frozenset()
        self._type_versions[type_url] = self._type_versions.get(type_url, 0) + 1
        names = frozenset(changed)
        for watcher in list(self._watchers):
            watcher(type_url, names)
        return names

    # -- watchers -------------------------------------------------------------------------

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Register a change callback; returns the function that unregisters it."""
        self._watchers.append(watcher)

        def cancel() -> None:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

        return cancel

    @property
    def watcher_count(self) -> int:
        return len(self._watchers)
