"""Every resource decoder on the control channel (xds/resources.py DECODERS: EndpointState,
PrefixDigest, PoolDemandReport), through `decode(type_url, body)` as the control plane and
the subscriber call it.

The input is a resource body, given to each decoder. Each returns a value or raises
ResourceError (xds/resources.py: "never another exception"); a decoded value must encode
and decode back to itself. Documented error: ResourceError only.
"""

from __future__ import annotations

from collections.abc import Callable

from fuzz.common import agree, outcome

INCLUDE = ["xds", "filters"]


def setup() -> Callable[[bytes], None]:
    from xds import resources
    from xds.resources import ResourceError

    documented = (ResourceError,)

    def one_input(data: bytes) -> None:
        for type_url in resources.DECODERS:
            got = outcome(documented, resources.decode, type_url, data)
            if got[0] == "ok":
                value = resources.decode(type_url, data)
                again = outcome(documented, resources.decode, type_url, value.encode())
                agree(f"{type_url} round trip", again, got, ("re-decoded", "decoded"))

    return one_input
