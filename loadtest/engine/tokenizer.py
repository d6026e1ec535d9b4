"""Deterministic text for the engine simulator: tokenizer, chat template, token generator.

Word tokenizer (the default). Text splits into pieces by the regex
`\\s*\\w+ | \\s*[^\\w\\s] | \\s+`: a word or one punctuation mark with the whitespace before
it, or trailing whitespace alone. Concatenating the pieces gives the text back. A piece's
id is `256 + blake2b-64(piece.strip()) mod (128256 - 256)` (Llama 3's vocabulary size), so
ids are stable across processes and machines; whitespace-only pieces get id 220.

Generation. Token i of a request is a pure function of (seed, position, the previous three
context ids), where the context is the prompt's ids without whitespace-only ones followed
by the tokens generated so far, and position is the context's length. Every generated
piece is `" word"`, `"."` or `","`, so the text of a prompt plus the first k generated
tokens tokenizes to the prompt's context plus exactly those k ids: a continuation request
(prompt + the text streamed so far) yields tokens k+1.. of the original. Chat requests get
the same property through the template below.

Chat template (documented, simple, continuable)::

    <|{role}|>\\n{content}\\n            for each message
    <|assistant|>\\n                     if add_generation_prompt (the default)

With `continue_final_message` the last message is rendered without its closing newline,
so the assistant's partial answer is continued in place, as vLLM does.

An optional real tokenizer (`tokenizers` tokenizer.json) keeps the same generation rule,
drawing generated ids from vocabulary entries that are a space marker plus letters.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

VOCAB_SIZE = 128_256
WHITESPACE_ID = 220
_ID_BASE = 256
_ID_SPAN = VOCAB_SIZE - _ID_BASE
_MASK64 = (1 << 64) - 1
# Bounds the piece -> id memo; prompts repeat words, so hits are the common case.
PIECE_CACHE_MAX = 1 << 17

_PIECE_RE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")
_PACK_KEY = struct.Struct("<Qqqqq").pack

# The generation vocabulary: common English words (readable gibberish) and two marks.
GEN_WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is that it for was on are as with his they at be this from have or
    by one had not but what all were when we there can an your which their said if do will
    each about how up out them then she many some so these would other into has more her two
    like him see time could no make than first been its who now people my made over did down
    only way find use may water long little very after words called just where most know get
    through back much go good new write our used me man too any day same right look think
    also around another came come work three word must because does part even place well such
    here take why help put different away again off went old number great tell men say small
    every found still between name should home big give air line set own under read last
    never us left end along while might next sound below saw something thought both few those
    always looked show large often together asked house world going want school important
    until form food keep children feet land side without boy once animals life enough took
    sometimes four head above kind began almost live page got earth need far hand high year
    mother light country father let night picture being study second soon story since white
    ever paper hard near sentence better best across during today however sure knew try told
    young sun thing whole hear example heard several change answer room sea against top
    turned learn point city play toward five himself usually money seen car morning river
    """.split()  # noqa: SIM905 - a word list reads better as text
)
GEN_MARKS: tuple[str, ...] = (".", ",")


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def is_context(self, token_id: int) -> bool:
        """Whether a token counts as generation context (whitespace-only ones do not)."""
        ...

    def generation_vocab(self) -> Sequence[tuple[int, str]]:
        """(id, piece) pairs the generator draws from; pieces must re-tokenize to id."""
        ...


def _piece_id(core: str) -> int:
    digest = hashlib.blake2b(core.encode("utf-8"), digest_size=8).digest()
    return _ID_BASE + int.from_bytes(digest, "big") % _ID_SPAN


class WordTokenizer:
    """The default deterministic word-level tokenizer (see the module docstring)."""

    name = "word"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        # id -> first piece seen with it, for /detokenize (ids are one-way hashes).
        self._pieces: dict[int, str] = {WHITESPACE_ID: " "}
        self._vocab = tuple((self.encode(p)[0], p) for p in self._gen_pieces())

    @staticmethod
    def _gen_pieces() -> Iterable[str]:
        yield from (" " + w for w in GEN_WORDS)
        yield from GEN_MARKS

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        out: list[int] = []
        append = out.append
        for piece in _PIECE_RE.findall(text):
            tid = ids.get(piece)
            if tid is None:
                core = piece.strip()
                tid = _piece_id(core) if core else WHITESPACE_ID
                if len(ids) >= PIECE_CACHE_MAX:
                    ids.clear()
                ids[piece] = tid
                if len(self._pieces) < PIECE_CACHE_MAX:
                    self._pieces.setdefault(tid, piece)
            append(tid)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        pieces = self._pieces
        return "".join(pieces.get(i, f" <{i}>") for i in ids)

    def is_context(self, token_id: int) -> bool:
        return token_id != WHITESPACE_ID

    def generation_vocab(self) -> Sequence[tuple[int, str]]:
        return self._vocab


class HFTokenizer:
    """A real `tokenizers` tokenizer.json (optional dependency: `pip install tokenizers`)."""

    name = "hf"

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError(
                "a tokenizer.json needs the `tokenizers` package: pip install tokenizers"
            ) from exc
        self._tok = _HF.from_file(path)
        vocab: Mapping[str, int] = self._tok.get_vocab()
        # Byte-level BPE marks a leading space with "Ġ", SentencePiece with "▁"; such a
        # token after any other token re-tokenizes to itself because pre-tokenizers split
        # on spaces, which is what the continuation property needs.
        word = re.compile(r"^[\u0120\u2581][a-z]{2,}$")
        picks = sorted((i, t) for t, i in vocab.items() if word.match(t))
        if not picks:
            raise RuntimeError(f"{path}: no space-prefixed alphabetic tokens to generate from")
        self._vocab = tuple((i, self._tok.decode([i])) for i, _ in picks[:4096])
        self._space_ids = {i for t, i in vocab.items() if t.strip("\u0120\u2581 \n\t") == ""}

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def is_context(self, token_id: int) -> bool:
        return token_id not in self._space_ids

    def generation_vocab(self) -> Sequence[tuple[int, str]]:
        return self._vocab


@dataclass(frozen=True, slots=True)
class NextToken:
    token_id: int
    piece: str
    eos: bool


class TokenGenerator:
    """Token i = f(seed, position, last three context ids); see the module docstring.

    `eos_rate` is the chance that a position ends the answer (only for requests without
    ignore_eos); 0 means answers run to max_tokens or a stop string.
    """

    __slots__ = ("_eos_threshold", "_ids", "_pieces", "_size", "tokenizer")

    def __init__(self, tokenizer: Tokenizer, eos_rate: float = 0.0) -> None:
        if not 0.0 <= eos_rate < 1.0:
            raise ValueError("eos_rate must be in [0, 1)")
        self.tokenizer = tokenizer
        vocab = tokenizer.generation_vocab()
        self._ids = tuple(i for i, _ in vocab)
        self._pieces = tuple(p for _, p in vocab)
        self._size = len(vocab)
        self._eos_threshold = int(eos_rate * (1 << 32))

    def context_tail(self, prompt_ids: Sequence[int]) -> tuple[tuple[int, int, int], int]:
        """(last three context ids, context length) of a prompt."""
        is_ctx = self.tokenizer.is_context
        ctx = [t for t in prompt_ids if is_ctx(t)]
        tail = [-1, -1, -1, *ctx[-3:]][-3:]
        return (tail[0], tail[1], tail[2]), len(ctx)

    def next(self, tail: tuple[int, int, int], position: int, seed: int) -> NextToken:
        key = _PACK_KEY(seed & _MASK64, position, tail[0], tail[1], tail[2])
        r = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        k = (r & 0xFFFFFFFF) % self._size
        eos = (r >> 32) < self._eos_threshold
        return NextToken(self._ids[k], self._pieces[k], eos)


def message_text(content: Any) -> str:
    """A chat message's content as text (a string, or OpenAI content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ValueError("only text content parts are supported")
        return "".join(parts)
    raise ValueError("message content must be a string or a list of content parts")


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The documented chat template (module docstring)."""
    out: list[str] = []
    last = len(messages) - 1
    for i, m in enumerate(messages):
        role = str(m.get("role", "user"))
        text = message_text(m.get("content"))
        out.append(
            f"<|{role}|>\n{text}"
            if continue_final_message and i == last
            else f"<|{role}|>\n{text}\n"
        )
    if add_generation_prompt and not continue_final_message:
        out.append("<|assistant|>\n")
    return "".join(out)


def load_tokenizer(path: str | None) -> Tokenizer:
    """The word tokenizer, or a tokenizer.json when a path is given."""
    return WordTokenizer() if not path else HFTokenizer(path)
