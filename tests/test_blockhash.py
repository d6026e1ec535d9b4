"""Block hashing: both twins against the `xxhash` package, against each other, and
against golden values that must never change (they key prefix caches across versions)."""

from __future__ import annotations

import importlib
import types

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from filters import blockhash as pure

compiled: types.ModuleType | None
try:
    compiled = importlib.import_module("filters._blockhash_c")
except ImportError:  # pragma: no cover - depends on the build
    compiled = None

NOT_BUILT = "compiled twin filters._blockhash_c not built (run setup.py build_ext --inplace)"
IMPLS = [
    pytest.param(pure, id="pure"),
    pytest.param(
        compiled, id="cython", marks=pytest.mark.skipif(compiled is None, reason=NOT_BUILT)
    ),
]
needs_compiled = pytest.mark.skipif(compiled is None, reason=NOT_BUILT)

u64 = st.integers(min_value=0, max_value=2**64 - 1)
names = st.text(max_size=20)


def oracle_chain(data: bytes, model: str, salt: str, block_size: int) -> list[int]:
    """The documented chain, computed with the xxhash package."""
    h = xxhash.xxh64_intdigest(b"meshd-v1\x00" + model.encode() + b"\x00" + salt.encode(), 0)
    out = []
    for off in range(0, len(data) - block_size + 1, block_size):
        h = xxhash.xxh64_intdigest(data[off : off + block_size], h)
        out.append(h)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), seed=u64)
def test_xxh64_matches_xxhash(impl: types.ModuleType, data: bytes, seed: int) -> None:
    assert impl.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [*range(0, 70), 127, 128, 129, 1000, 4099])
def test_xxh64_every_tail_length(impl: types.ModuleType, n: int) -> None:
    # Every combination of 32-byte stripes and 8/4/1-byte tails.
    data = bytes((i * 131 + 7) % 256 for i in range(n))
    for seed in (0, 1, 2**63, 2**64 - 1):
        assert impl.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=150, deadline=None)
@given(
    data=st.binary(max_size=600),
    model=names,
    salt=names,
    block_size=st.integers(min_value=1, max_value=130),
)
def test_block_hashes_match_oracle(
    impl: types.ModuleType, data: bytes, model: str, salt: str, block_size: int
) -> None:
    assert impl.block_hashes(data, model, salt, block_size) == oracle_chain(
        data, model, salt, block_size
    )


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(
    data=st.one_of(st.binary(max_size=700), st.text(max_size=300)),
    model=names,
    salt=names,
    block_size=st.integers(min_value=1, max_value=200),
)
def test_twins_equal(data: str | bytes, model: str, salt: str, block_size: int) -> None:
    assert compiled is not None
    assert compiled.block_hashes(data, model, salt, block_size) == pure.block_hashes(
        data, model, salt, block_size
    )
    assert compiled.seed_for(model, salt) == pure.seed_for(model, salt)


@pytest.mark.parametrize("impl", IMPLS)
def test_golden_values(impl: types.ModuleType) -> None:
    # Computed once with xxhash 3.x; a change here invalidates every deployed prefix index.
    text = "The quick brown fox jumps over the lazy dog. " * 4  # 180 bytes: 2 full blocks
    assert impl.seed_for("llama-3-8b", "tenant-a") == 0xC5D9FF35BEE0637C
    assert impl.seed_for("llama-3-8b") == 0x8314740307C14538
    assert impl.block_hashes(text, "llama-3-8b", "tenant-a") == [
        0x909EEAD43A567F71,
        0x4460A2C106B134CE,
    ]


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=100, deadline=None)
@given(
    prefix=st.binary(max_size=400),
    a=st.binary(max_size=200),
    b=st.binary(max_size=200),
    block_size=st.sampled_from([1, 7, 16, 64]),
)
def test_shared_prefix_shares_hashes(
    impl: types.ModuleType, prefix: bytes, a: bytes, b: bytes, block_size: int
) -> None:
    ha = impl.block_hashes(prefix + a, "m", "", block_size)
    hb = impl.block_hashes(prefix + b, "m", "", block_size)
    k = len(prefix) // block_size
    assert ha[:k] == hb[:k]
    # Past the first differing block the chains differ (2**-64 odds of a collision).
    first_diff = next(
        (i for i, (x, y) in enumerate(zip(prefix + a, prefix + b, strict=False)) if x != y),
        None,
    )
    if first_diff is not None:
        j = first_diff // block_size
        if j < len(ha) and j < len(hb):
            assert ha[j] != hb[j]


@pytest.mark.parametrize("impl", IMPLS)
def test_only_full_blocks(impl: types.ModuleType) -> None:
    assert impl.block_hashes(b"x" * 63, "m") == []
    assert len(impl.block_hashes(b"x" * 64, "m")) == 1
    assert len(impl.block_hashes(b"x" * 127, "m")) == 1
    assert impl.block_hashes(b"x" * 127, "m") == impl.block_hashes(b"x" * 64, "m")
    assert impl.block_hashes(b"", "m") == []


@pytest.mark.parametrize("impl", IMPLS)
def test_model_and_salt_change_every_hash(impl: types.ModuleType) -> None:
    data = bytes(range(256)) * 2
    base = impl.block_hashes(data, "m")
    for other in (impl.block_hashes(data, "m2"), impl.block_hashes(data, "m", "s")):
        assert len(other) == len(base) == 8
        assert all(x != y for x, y in zip(base, other, strict=True))
    # The separator keeps ("ab", "") and ("a", "b") apart.
    assert impl.seed_for("ab", "") != impl.seed_for("a", "b")


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=300), block_size=st.integers(min_value=1, max_value=64))
def test_str_is_utf8_bytes(impl: types.ModuleType, text: str, block_size: int) -> None:
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError):
            impl.block_hashes(text, "m", "", block_size)
        return
    expected = impl.block_hashes(encoded, "m", "", block_size)
    assert impl.block_hashes(text, "m", "", block_size) == expected
    assert impl.block_hashes(bytearray(encoded), "m", "", block_size) == expected
    assert impl.block_hashes(memoryview(encoded), "m", "", block_size) == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_results_are_unsigned_64_bit(impl: types.ModuleType) -> None:
    hs = impl.block_hashes(bytes(range(256)) * 40, "m", "s", 8)
    assert len(hs) == 1280
    assert all(type(h) is int and 0 <= h < 2**64 for h in hs)
    assert len(set(hs)) == len(hs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [0, -1, -64])
def test_block_size_must_be_positive(impl: types.ModuleType, block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        impl.block_hashes(b"abc", "m", "", block_size)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_types(impl: types.ModuleType) -> None:
    with pytest.raises(TypeError):
        impl.block_hashes(12345, "m")
    with pytest.raises(TypeError):
        impl.block_hashes(b"x", b"m")
    with pytest.raises(TypeError):
        impl.block_hashes(b"x", "m", None)
    with pytest.raises(TypeError):
        impl.block_hashes(b"x", "m", "", 64.0)
    with pytest.raises(UnicodeEncodeError):
        impl.block_hashes("\ud800" * 100, "m")


class _Bytes(bytes):
    pass


def _outcome(impl: types.ModuleType, *args: object) -> object:
    try:
        return ("ok", impl.block_hashes(*args))
    except (TypeError, ValueError) as exc:
        return ("raised", type(exc).__name__)


@needs_compiled
@pytest.mark.parametrize(
    "args",
    [
        (b"", "m"),
        (b"x" * 63, "m", "", 64),  # no whole block
        (b"x" * 64, "m", "", 64),
        (_Bytes(b"y" * 130), "m", "s", 64),  # a bytes subclass is read in place too
        (b"x" * 10, "m", "", True),  # an int-like block size
        (b"", "\ud800"),  # the seed's model is encoded even with no block to hash
        (b"x" * 100, "m", "\udfff", 8),
        (bytearray(b"x" * 10), "m", "", 3),
        ("", "m", "", 1),
    ],
)
def test_the_twins_agree_on_odd_arguments(args: tuple[object, ...]) -> None:
    assert _outcome(compiled, *args) == _outcome(pure, *args)  # type: ignore[arg-type]


def test_hotpath_picks_an_implementation() -> None:
    from filters import hotpath

    assert hotpath.block_hashes(b"y" * 128, "m") == pure.block_hashes(b"y" * 128, "m")
    if compiled is not None and hotpath.IMPLEMENTATION == "cython":
        assert hotpath.block_hashes is compiled.block_hashes


@pytest.mark.parametrize("forced", [True, False])
def test_hotpath_env_switch(forced: bool) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MESHD_PURE_PYTHON"}
    if forced:
        env["MESHD_PURE_PYTHON"] = "1"
    out = subprocess.run(
        [
            sys.executable,
            *(["-S"] if sys.flags.no_site else []),  # same import world as this process
            "-c",
            "from filters import hotpath; print(hotpath.IMPLEMENTATION)",
        ],
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if forced:
        assert out == "python (forced by MESHD_PURE_PYTHON)"
    elif compiled is not None:
        assert out == "cython"
    else:
        assert out == "python (compiled extensions not built)"
