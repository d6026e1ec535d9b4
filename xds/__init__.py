"""The control channel: xDS transport semantics on grpcio (see DESIGN.md).

`xds-protos` also installs a top-level `xds` package (the CNCF xds.core.v3 protos that
Envoy's messages import), which this one shadows; extending `__path__` lets
`xds.core.v3...` resolve to it. Our module names never clash with theirs
(annotations, core, data, service, type).
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
