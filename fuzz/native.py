"""Coverage-instrumented copies of the Cython twins, for `python -m fuzz --native` (issue #21).

The repository's own extensions (setup.py, the system compiler) carry no SanitizerCoverage, so
libFuzzer sees nothing of what happens inside them. Here each `filters/_*_c.pyx` and
`xds/_*_c.pyx` is translated with Cython (the directives setup.py uses) and compiled with the
clang that the `ziglang` wheel ships (`python -m ziglang cc`; no system clang needed) with
`-fsanitize=fuzzer-no-link`, the flag atheris's native_extension_fuzzing.md asks for (clang's
inline 8-bit counters, PC table, comparison tracing, indirect calls, stack depth), into a cache
directory (default `.fuzz-build/`, git-ignored): never over the repository's .so files.

The modules leave the `__sanitizer_cov_*` symbols undefined; libFuzzer defines them. The
atheris wheel links libFuzzer into `atheris.core_with_libfuzzer`, a Python extension that the
interpreter loads RTLD_LOCAL, where an instrumented module cannot see it. `activate` (in the
fuzzing process, before the target imports anything) loads it RTLD_GLOBAL, maps the compiled
twins' module names to the instrumented files ahead of the normal path, and run_one then tells
atheris to use that same built-in libFuzzer (`internal_libfuzzer=True`): otherwise atheris finds
libFuzzer already loaded, imports `core_without_libfuzzer` too, and the two copies of its C++
globals clash ("You must call Setup() before Fuzz()"). No LD_PRELOAD: the wheel ships no
`asan_with_fuzzer.so`, and preloading `core_with_libfuzzer` clashes the same way.

No AddressSanitizer: the ziglang wheel has no ASan runtime (`zig cc -fsanitize=address` fails to
link, "undefined symbol: __asan_register_elf_globals"), nor does the atheris wheel. A memory error
shows only if it crashes (libFuzzer reports the deadly signal and saves the input); the targets'
differential checks catch wrong results as before.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".fuzz-build"
PACKAGES = ("filters", "xds")

# setup.py's cythonize directives; the C flags are Python's own (-fwrapv, NDEBUG) at -O2 for a
# generic CPU of this architecture (the cache may move between machines), plus the coverage.
DIRECTIVES = ("language_level=3", "boundscheck=False", "wraparound=False")
COVERAGE = ("-fsanitize=fuzzer-no-link",)
CFLAGS = ("-O2", "-fPIC", "-fwrapv", "-DNDEBUG", "-mcpu=baseline", "-w", *COVERAGE)
# -nostdlib: the interpreter has libc and libpython loaded; linking against them would first
# make zig build its libc stubs (~20 s on an empty zig cache) for nothing.
LDFLAGS = ("-shared", "-nostdlib")

# Read once, here: sysconfig's first look-up is not thread-safe (build() compiles in threads,
# and a racing get_config_var("EXT_SUFFIX") was seen to return None).
EXT_SUFFIX: str = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
INCLUDES = sorted({sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]})


@dataclass(frozen=True)
class Extension:
    name: str  # "filters._sse_c"
    pyx: Path

    @property
    def filename(self) -> str:
        package, _, module = self.name.rpartition(".")
        return f"{package}/{module}{EXT_SUFFIX}"


def extensions() -> list[Extension]:
    """Every compiled twin setup.py builds (filters/_*_c.pyx, xds/_*_c.pyx)."""
    found = []
    for package in PACKAGES:
        for pyx in sorted((REPO / package).glob("_*_c.pyx")):
            found.append(Extension(f"{package}.{pyx.stem}", pyx))
    return found


def missing() -> str | None:
    """Why an instrumented build cannot be made here, or None when it can."""
    for module, package in (("ziglang", "ziglang"), ("Cython", "Cython")):
        if importlib.util.find_spec(module) is None:
            return f"{package} not installed (pip install -e '.[fuzz]')"
    if sys.platform != "linux":
        return f"--native is Linux only (libFuzzer inside atheris's wheel), not {sys.platform}"
    return None


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _key(ext: Extension) -> str:
    h = hashlib.sha256()
    for part in (
        sys.version,
        *INCLUDES,
        _version("Cython"),
        _version("ziglang"),
        repr((DIRECTIVES, CFLAGS, LDFLAGS)),
    ):
        h.update(part.encode() + b"\0")
    # Every package's declarations, not only the module's own folder's: xds/ modules
    # cimport filters/_slots.pxd and filters/_endpoint_state_c.pxd.
    pxds = sorted(p for package in PACKAGES for p in (REPO / package).glob("*.pxd"))
    for src in [ext.pyx, *pxds]:
        h.update(f"{src.parent.name}/{src.name}".encode() + b"\0" + src.read_bytes())
    return h.hexdigest()


def _run(args: Sequence[str], what: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, errors="replace")
    if proc.returncode:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr}")


def build_one(ext: Extension, dest: Path) -> tuple[Path, bool]:
    """The instrumented module under dest (and whether it was built now, not cached)."""
    out = dest / ext.filename
    stamp = out.with_name(out.name + ".key")
    key = _key(ext)
    if out.exists() and stamp.exists() and stamp.read_text() == key:
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix=f"{ext.pyx.stem}-", dir=out.parent) as tmp:
        c, o, so = Path(tmp, "m.c"), Path(tmp, "m.o"), Path(tmp, "m.so")
        directives = [a for d in DIRECTIVES for a in ("-X", d)]
        # Cython names the module from the package the .pyx sits in (filters._sse_c).
        _run([py, "-m", "cython", *directives, str(ext.pyx), "-o", str(c)], "cython")
        flags = [f"-I{i}" for i in INCLUDES]
        _run([py, "-m", "ziglang", "cc", "-c", *CFLAGS, *flags, str(c), "-o", str(o)], "zig cc")
        _run([py, "-m", "ziglang", "cc", *LDFLAGS, str(o), "-o", str(so)], "zig cc (link)")
        os.replace(so, out)  # atomic: a concurrent run sees the old file or the new one
    stamp.write_text(key)
    return out, True


def build(
    dest: Path = CACHE, names: Iterable[str] | None = None, jobs: int | None = None
) -> dict[str, Path]:
    """Build (or reuse from dest) the instrumented twins named (default: all); name -> file."""
    reason = missing()
    if reason:
        raise RuntimeError(f"cannot build instrumented extensions: {reason}")
    exts = extensions()
    if names is not None:
        wanted = set(names)
        unknown = wanted - {e.name for e in exts}
        if unknown:
            raise KeyError(f"no such extension: {', '.join(sorted(unknown))}")
        exts = [e for e in exts if e.name in wanted]
    start = time.monotonic()
    with ThreadPoolExecutor(jobs or os.cpu_count() or 2) as pool:
        done = list(pool.map(lambda e: build_one(e, dest), exts))
    fresh = sum(1 for _, new in done if new)
    print(
        f"native: {len(done)} instrumented extension(s) in {dest} "
        f"({fresh} built, {len(done) - fresh} cached, {time.monotonic() - start:.1f} s)",
        flush=True,
    )
    return {e.name: path for e, (path, _) in zip(exts, done, strict=True)}


def built(dest: Path) -> dict[str, Path]:
    """The instrumented modules present under dest: module name -> file."""
    found = {}
    for package in PACKAGES:
        for f in sorted((dest / package).glob(f"*{EXT_SUFFIX}")):
            found[f"{package}.{f.name.removesuffix(EXT_SUFFIX)}"] = f
    return found


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the instrumented file for a compiled twin's name, ahead of the package path."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        f = self.files.get(fullname)
        if f is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(f))
        return importlib.util.spec_from_file_location(fullname, f, loader=loader)


def activate(dest: Path) -> dict[str, Path]:
    """In the fuzzing process, before the target's imports: libFuzzer's symbols made global
    (atheris.core_with_libfuzzer loaded RTLD_GLOBAL) and the compiled twins' names mapped to
    the instrumented files under dest. Returns what was mapped."""
    files = built(dest)
    if not files:
        raise RuntimeError(f"no instrumented extensions in {dest} (python -m fuzz --native)")
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_GLOBAL)
    try:
        import atheris.core_with_libfuzzer  # noqa: F401
    finally:
        sys.setdlopenflags(flags)
    sys.meta_path.insert(0, _Finder(files))
    return files


def report(files: dict[str, Path]) -> list[str]:
    """One line per mapped module the target imported, naming the file it came from."""
    lines = []
    for name in sorted(files):
        mod = sys.modules.get(name)
        if mod is not None:
            lines.append(f"INFO: native: {name} {getattr(mod, '__file__', '?')}")
    return lines
