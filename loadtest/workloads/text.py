"""Deterministic word-level text for planned prompts.

Token i of block b is a pure function of (b, i, seed): one word of a fixed 4096-word
vocabulary chosen by BLAKE2b, so equal block ids always give identical text and a shared
run of leading block ids gives a shared text prefix. One word is one token for the
whitespace tokenizer of the engine simulator (`count_tokens`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

VOCABULARY_SIZE = 4096
_CONSONANTS = "bdfghjklmnprstvz"
_VOWELS = "aeiou"
# 32 words per 64-byte digest (2 bytes each); 65536 is a multiple of 4096, so the modulo
# below is unbiased.
_WORDS_PER_DIGEST = 32
_DIGEST_WORDS = struct.Struct(">32H")
_WORD_PERSON = b"meshd.words"
_BLOCK_ID_PERSON = b"meshd.blockid"
MAX_BLOCK_ID = (1 << 63) - 1


def _build_vocabulary() -> tuple[str, ...]:
    # Pronounceable consonant-vowel-consonant-vowel words: short, lowercase, free of
    # whitespace and punctuation, so a word is always exactly one whitespace token.
    every = [
        a + b + c + d for a in _CONSONANTS for b in _VOWELS for c in _CONSONANTS for d in _VOWELS
    ]
    return tuple(every[k * len(every) // VOCABULARY_SIZE] for k in range(VOCABULARY_SIZE))


VOCABULARY: tuple[str, ...] = _build_vocabulary()


def count_tokens(text: str) -> int:
    """Tokens of `text` for the word-level tokenizer: whitespace-separated words."""
    return len(text.split())


def _seed_key(seed: int) -> bytes:
    try:
        return seed.to_bytes(16, "big", signed=True)
    except OverflowError:
        raise ValueError(f"text seed {seed} does not fit in 128 bits") from None


def block_words(block_id: int, n_tokens: int, seed: int = 0) -> list[str]:
    """The first `n_tokens` words of block `block_id` under `seed`.

    A shorter block is a prefix of a longer one with the same id (a partial last block
    shares its text with the full block of the same id).
    """
    if not 0 <= block_id <= MAX_BLOCK_ID:
        raise ValueError(f"block id {block_id} outside 0..2**63-1")
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    key = _seed_key(seed)
    prefix = block_id.to_bytes(8, "big")
    words: list[str] = []
    for chunk in range(-(-n_tokens // _WORDS_PER_DIGEST)):
        digest = hashlib.blake2b(
            prefix + chunk.to_bytes(4, "big"), digest_size=64, key=key, person=_WORD_PERSON
        ).digest()
        words.extend(VOCABULARY[i % VOCABULARY_SIZE] for i in _DIGEST_WORDS.unpack(digest))
    del words[n_tokens:]
    return words


def block_text(block_id: int, n_tokens: int, seed: int = 0) -> str:
    """`block_words` joined by single spaces: exactly `n_tokens` tokens."""
    return " ".join(block_words(block_id, n_tokens, seed))


def synthetic_block_id(*parts: str | int) -> int:
    """A 63-bit block id for generated text, namespaced by `parts`.

    Generators name their blocks by (workload name, seed, group, index...), so two
    workloads never share text by accident when mixed. Trace hash ids are small integers;
    a collision with a 63-bit hash is negligible (p ~ n^2 / 2^64).
    """
    encoded = "\x1f".join(f"{type(p).__name__}:{p}" for p in parts).encode()
    digest = hashlib.blake2b(encoded, digest_size=8, person=_BLOCK_ID_PERSON).digest()
    return int.from_bytes(digest, "big") & MAX_BLOCK_ID


def block_lengths(n_tokens: int, block_tokens: int) -> list[int]:
    """Split `n_tokens` into full blocks of `block_tokens` and one partial last block."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    full, rest = divmod(n_tokens, block_tokens)
    return [block_tokens] * full + ([rest] if rest else [])


def segment(
    namespace: Sequence[str | int], n_tokens: int, block_tokens: int
) -> tuple[str, tuple[int, ...]]:
    """Text of `n_tokens` tokens in blocks named `namespace + (j,)`, and their block ids."""
    ids: list[int] = []
    texts: list[str] = []
    for j, length in enumerate(block_lengths(n_tokens, block_tokens)):
        bid = synthetic_block_id(*namespace, j)
        ids.append(bid)
        texts.append(block_text(bid, length))
    return " ".join(texts), tuple(ids)


def join_text(parts: Iterable[str]) -> str:
    """Join non-empty text parts with single spaces (token counts add up)."""
    return " ".join(p for p in parts if p)
