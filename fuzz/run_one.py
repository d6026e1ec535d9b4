"""One target under atheris (libFuzzer): `python -m fuzz.run_one <target> [--strict]
[--native=DIR] [libFuzzer args]`. The target's modules are imported inside
atheris.instrument_imports, so Python coverage guides the search. The Cython twins run as
built by setup.py, without coverage (differentially checked), unless --native=DIR names a
directory of instrumented copies (fuzz/native.py: `python -m fuzz --native` builds them),
whose SanitizerCoverage counters then guide the search too. Known findings (the target's
KNOWN) are passed over unless --strict."""

from __future__ import annotations

import sys
from pathlib import Path

import atheris


def main() -> None:
    from fuzz import native as instrumented
    from fuzz.common import tolerating
    from fuzz.targets import known, module

    target = sys.argv[1]
    args = sys.argv[2:]
    strict = "--strict" in args
    native = [a.removeprefix("--native=") for a in args if a.startswith("--native=")]
    args = [a for a in args if a != "--strict" and not a.startswith("--native=")]
    files = instrumented.activate(Path(native[-1])) if native else {}
    mod = module(target)
    with atheris.instrument_imports(include=mod.INCLUDE):
        one_input = mod.setup()
    for line in instrumented.report(files):
        print(line, file=sys.stderr, flush=True)
    if not strict:
        one_input = tolerating(one_input, known(target))
    # With --native, libFuzzer is already loaded (globally, from atheris.core_with_libfuzzer):
    # atheris must keep using that one, not load core_without_libfuzzer beside it.
    extra = {"internal_libfuzzer": True} if files else {}
    atheris.Setup([sys.argv[0], *args], one_input, **extra)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
