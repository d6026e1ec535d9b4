"""Prefix block hashes: filters/_blockhash_c.pyx against filters/blockhash.py (and the
`xxhash` package, when installed, for XXH64 itself).

The input's first byte picks the block size (1-128), the rest is the prompt: hashed as
bytes, and as text (decoded UTF-8 with surrogateescape, so lone surrogates reach the
str path). Both twins must return the same list or raise the same error; documented errors:
UnicodeEncodeError for a str with lone surrogates (ValueError/TypeError need arguments a
caller never passes here).
"""

from __future__ import annotations

from collections.abc import Callable

from fuzz.common import agree, outcome

INCLUDE = ["filters"]


def setup() -> Callable[[bytes], None]:
    from filters import _blockhash_c as compiled  # type: ignore[attr-defined]
    from filters import blockhash as pure

    xxh64_ref: Callable[[bytes, int], int] | None
    try:
        import xxhash
    except ImportError:  # the test extra has it; the check is optional
        xxh64_ref = None
    else:
        xxh64_ref = xxhash.xxh64_intdigest

    documented = (UnicodeEncodeError,)

    def one_input(data: bytes) -> None:
        block_size = 1 + data[0] % 128 if data else 64
        body = data[1:]
        text = body.decode("utf-8", "surrogateescape")
        model = "fuzz/model"
        for prompt in (body, text):
            agree(
                f"block_hashes block_size={block_size} {type(prompt).__name__}",
                outcome(documented, compiled.block_hashes, prompt, model, "s", block_size),
                outcome(documented, pure.block_hashes, prompt, model, "s", block_size),
            )
        seed = len(body) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        want = compiled.xxh64(body, seed)
        agree("xxh64", want, pure.xxh64(body, seed))
        if xxh64_ref is not None:
            agree("xxh64", want, xxh64_ref(body, seed), ("compiled", "xxhash"))

    return one_input
