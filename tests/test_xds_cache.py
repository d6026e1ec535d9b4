"""xds/cache.py: versions and change notification of the snapshot cache."""

from __future__ import annotations

from xds.cache import SnapshotCache, resource_version

T = "type.googleapis.com/meshd.v1.EndpointState"


def test_versions_and_notifications() -> None:
    cache = SnapshotCache()
    seen: list[tuple[str, frozenset[str]]] = []
    cancel = cache.watch(lambda t, names: seen.append((t, names)))
    assert cache.type_version(T) == 0
    assert cache.set(T, "a", b"1")
    assert cache.get(T, "a") is not None
    assert cache.get(T, "a").version == resource_version(b"1")  # type: ignore[union-attr]
    assert cache.type_version(T) == 1
    # The same bytes again is no change: no bump, no notification.
    assert not cache.set(T, "a", b"1")
    assert cache.type_version(T) == 1
    assert cache.update(T, {"a": b"2", "b": b"x"}) == {"a", "b"}
    assert cache.type_version(T) == 2
    assert cache.remove(T, "b")
    assert not cache.remove(T, "b")
    assert cache.type_version(T) == 3
    assert seen == [(T, frozenset({"a"})), (T, frozenset({"a", "b"})), (T, frozenset({"b"}))]
    cancel()
    cache.set(T, "c", b"y")
    assert len(seen) == 3
    assert set(cache.resources(T)) == {"a", "c"}


def test_resource_version_is_content_hash() -> None:
    # Two replicas with the same bytes agree on the version; different bytes differ.
    assert resource_version(b"abc") == resource_version(b"abc")
    assert resource_version(b"abc") != resource_version(b"abd")
    assert len(resource_version(b"")) == 16
