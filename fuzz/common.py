"""What the fuzz targets share: a comparable outcome of a call (value or error), typed
deep values (so 1 == True == 1.0 do not hide a twin's type slip), and deterministic
read splits derived from the input itself."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# Bytes a target reads at most; libFuzzer's -max_len is set to this too.
MAX_LEN = 4096


class Finding(AssertionError):
    """A property a target checks does not hold; `what` names the property."""

    def __init__(self, what: str, message: str = "") -> None:
        super().__init__(message or what)
        self.what = what


class Disagreement(Finding):
    """The two twins (or the whole and the split feed) gave different outcomes."""


def require(ok: object, what: str, detail: object = "") -> None:
    if not ok:
        raise Finding(what, f"{what}: {detail}" if detail != "" else what)


def typed(v: Any) -> Any:
    """`v` with the type of every value beside it, recursively (dict keys included)."""
    if isinstance(v, dict):
        return ("dict", [(typed(k), typed(w)) for k, w in v.items()])
    if isinstance(v, list | tuple):
        return (type(v).__name__, [typed(w) for w in v])
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = [(f.name, typed(getattr(v, f.name))) for f in dataclasses.fields(v)]
        return (type(v).__name__, fields)
    if isinstance(v, float) and v != v:
        return ("float", "nan")
    return (type(v).__name__, v)


def outcome(
    documented: tuple[type[BaseException], ...], call: Callable[..., Any], *args: Any
) -> Any:
    """("ok", typed value of call(*args)) or ("error", class name, message) for a documented
    error class; any other exception propagates (the fuzzer reports it)."""
    try:
        return ("ok", typed(call(*args)))
    except documented as exc:
        return ("error", type(exc).__name__, str(exc))


def agree(what: str, a: Any, b: Any, labels: tuple[str, str] = ("compiled", "pure")) -> None:
    if a != b:
        raise Disagreement(what, f"{what}: {labels[0]} and {labels[1]} disagree:\n  {a!r}\n  {b!r}")


def splits(data: bytes, most: int = 8) -> list[bytes]:
    """`data` cut into reads at points chosen from the data itself (crc32 as the seed), so
    a corpus file replays the same way every time and the fuzzer steers them by mutation."""
    if len(data) < 2:
        return [data] if data else []
    seed = zlib.crc32(data)
    if seed % 13 == 0 and len(data) <= 512:
        return [data[i : i + 1] for i in range(len(data))]  # h11's property: byte by byte
    count = 1 + seed % most
    points = set()
    x = seed
    for _ in range(count):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        points.add(1 + x % (len(data) - 1))
    pieces, last = [], 0
    for p in sorted(points):
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return pieces


_ROOT = Path(__file__).resolve().parent.parent


def signature(exc: BaseException) -> str:
    """Where an exception came from, stable across edits: its class, and the file and
    function of the innermost frame in meshd's own code (fuzz/ left out), e.g.
    "AttributeError in meshd/webhook.py:_mutate"; a Finding by the property's name
    ("Disagreement: statuses")."""
    if isinstance(exc, Finding):
        return f"{type(exc).__name__}: {exc.what}"
    where = "?"
    tb = exc.__traceback__
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename)
        if path.is_relative_to(_ROOT) and not path.is_relative_to(_ROOT / "fuzz"):
            where = f"{path.relative_to(_ROOT)}:{tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return f"{type(exc).__name__} in {where}"


def tolerating(
    one_input: Callable[[bytes], None], known: Mapping[str, str]
) -> Callable[[bytes], None]:
    """`one_input` with the known findings (reported, not yet fixed: the target's KNOWN,
    signature -> note) passed over, so a run searches past them instead of stopping at the
    first; anything else still propagates."""
    if not known:
        return one_input

    def guarded(data: bytes) -> None:
        try:
            one_input(data)
        except Exception as exc:
            if signature(exc) not in known:
                raise

    return guarded
