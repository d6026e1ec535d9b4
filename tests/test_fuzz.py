"""The fuzz targets (fuzz/, issue #21): every seed corpus file replayed through its target
in-process (no atheris needed, so a regression on a corpus input fails everywhere), the
known findings still reproduced as reported (they fail here once fixed: then rename the
file and drop its KNOWN entry), and each target fuzzed for a short fixed time under
atheris in a subprocess, with no crash."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # fuzz/ is not installed; `python -m pytest` from the root has it

from fuzz import native  # noqa: E402
from fuzz.__main__ import fuzz_one  # noqa: E402
from fuzz.common import signature  # noqa: E402
from fuzz.targets import TARGETS, known, load  # noqa: E402

CORPUS = ROOT / "fuzz" / "corpus"
SECONDS = 2  # per target: the whole file stays under ~40 s on 2 busy cores

HAVE_ATHERIS = importlib.util.find_spec("atheris") is not None
needs_atheris = pytest.mark.skipif(
    not HAVE_ATHERIS, reason="atheris not installed (pip install -e '.[fuzz]'): not fuzzed"
)


def _seeds(target: str, prefix_known: bool) -> list[Path]:
    return sorted(
        p for p in (CORPUS / target).iterdir() if p.name.startswith("known-") == prefix_known
    )


def _load(target: str) -> Callable[[bytes], None]:
    try:
        return load(target)
    except ImportError as exc:  # a compiled twin not built (setup.py build_ext --inplace)
        pytest.skip(f"{target}: {exc}")


@pytest.mark.parametrize("target", TARGETS)
def test_seed_corpus_replays_clean(target: str) -> None:
    seeds = _seeds(target, prefix_known=False)
    assert len(seeds) >= 3, f"fuzz/corpus/{target} needs a few seeds"
    one_input = _load(target)
    for path in seeds:
        one_input(path.read_bytes())  # an exception here names the failing property


@pytest.mark.parametrize(
    "target, path",
    [(t, p) for t in TARGETS for p in _seeds(t, prefix_known=True)],
    ids=lambda v: v.name if isinstance(v, Path) else v,
)
def test_known_findings_still_reproduce(target: str, path: Path) -> None:
    with pytest.raises(Exception) as info:
        _load(target)(path.read_bytes())
    assert signature(info.value) in known(target), (
        f"{path.name} now fails differently: {signature(info.value)}"
    )


def test_every_known_finding_has_a_reproducer() -> None:
    for target in TARGETS:
        if known(target):
            assert _seeds(target, prefix_known=True), f"{target}: KNOWN without a known-* file"


@needs_atheris
@pytest.mark.parametrize("target", TARGETS)
def test_short_fuzz_run_finds_nothing(target: str, tmp_path: Path) -> None:
    # A fixed seed: the same mutations every run, so CI does not fail by chance on a finding
    # the longer runs missed (those use the time as the seed).
    r = fuzz_one(target, SECONDS, None, tmp_path / "work", tmp_path / "artifacts", seed=1)
    assert r.crashes == 0 and r.rc == 0, r.tail
    assert r.executions > 0 and r.cov > 0, r


NATIVE_MISSING = native.missing()


@needs_atheris
@pytest.mark.skipif(
    NATIVE_MISSING is not None, reason=f"`python -m fuzz --native` not tested: {NATIVE_MISSING}"
)
def test_native_build_puts_coverage_inside_the_compiled_twin(tmp_path: Path) -> None:
    # One twin built with SanitizerCoverage (Cython, then the ziglang wheel's clang: ~10 s on 2
    # busy cores), then the same runs from the same seeds with and without it: the instrumented
    # module is the one imported, libFuzzer loaded its counters, and coverage counts them.
    build = tmp_path / "build"
    built = native.build(build, ["filters._sse_c"], jobs=1)
    assert list(built) == ["filters._sse_c"] and built["filters._sse_c"].is_relative_to(build)
    runs = 500
    plain = fuzz_one("sse", None, runs, tmp_path / "plain", tmp_path / "artifacts", seed=1)
    inst = fuzz_one(
        "sse", None, runs, tmp_path / "native", tmp_path / "artifacts", seed=1, native=build
    )
    assert inst.crashes == 0 and inst.rc == 0, inst.tail
    assert inst.native == (("filters._sse_c", str(built["filters._sse_c"])),), inst.tail
    assert inst.native_counters > 1000, inst.tail
    assert plain.native == () and plain.native_counters == 0, plain.tail
    # Python coverage alone is ~110 edges here; the twin's own add several hundred.
    assert inst.cov > plain.cov + 200, (inst, plain)
