"""One target under atheris (libFuzzer): `python -m fuzz.run_one <target> [libFuzzer args]`.
The target's modules are imported inside atheris.instrument_imports, so Python coverage
guides the search; the Cython twins run uninstrumented (differentially checked). Known findings
(the target's KNOWN) are passed over unless --strict."""

from __future__ import annotations

import sys

import atheris


def main() -> None:
    from fuzz.common import tolerating
    from fuzz.targets import known, module

    target = sys.argv[1]
    args = sys.argv[2:]
    strict = "--strict" in args
    args = [a for a in args if a != "--strict"]
    mod = module(target)
    with atheris.instrument_imports(include=mod.INCLUDE):
        one_input = mod.setup()
    if not strict:
        one_input = tolerating(one_input, known(target))
    atheris.Setup([sys.argv[0], *args], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
