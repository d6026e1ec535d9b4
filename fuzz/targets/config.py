"""The config loader (meshd/config.py load_config): a YAML file as an operator writes it,
with no environment variables; the input is also tried as a `--set KEY.PATH=VALUE`.

Documented error: ConfigError only (bad YAML, a top level that is not a mapping, a bad
value named by its key); anything else escaping is a finding, as is a ConfigError with no
problem in it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

INCLUDE = ["meshd", "yaml"]
# Found by this target, reported, not fixed yet (corpus: known-not-utf8).
KNOWN: dict[str, str] = {}  # findings fixed: their reproducers are fixed-* seeds now


def setup() -> Callable[[bytes], None]:
    from meshd.config import ConfigError, load_config

    # An in-memory file, named by /proc: nothing is left behind when atheris ends the
    # process with os._exit (atexit does not run then).
    fd = os.memfd_create("meshd-fuzz-config")
    path = f"/proc/self/fd/{fd}"

    def load(**kw: object) -> None:
        try:
            load_config(env={}, **kw)  # type: ignore[arg-type]
        except ConfigError as exc:
            assert exc.problems and all(exc.problems), exc.problems
            exc.render()

    def one_input(data: bytes) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        load(path=path)
        line = data.split(b"\n", 1)[0].decode("utf-8", "replace")
        load(overrides=[line])

    return one_input
