"""Characters (and UTF-8 bytes) per prompt token, learnt per model from the engines' usage.

Sans-I/O: the driver hands in (prompt characters, prompt bytes, usage.prompt_tokens) of a
successful response; the picker's inputs read the estimate back. Until a model has
`min_samples` samples there is no estimate (None): callers keep the fixed CHARS_PER_TOKEN.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from filters.request import estimate_prompt_tokens

# Each model keeps its last WINDOW accepted samples; the estimate is their median, so a
# burst of odd prompts (a base64 blob, a table of digits) moves it by at most one rank
# each, and a retokenised model (redeployment) replaces the window within WINDOW samples.
WINDOW = 64
MIN_SAMPLES = 8
MIN_PROMPT_CHARS = 64  # a short prompt is mostly chat template: its ratio says little
# Ratios outside these are a broken usage report or a prompt the engine truncated, not a
# tokenizer: Llama 3 on CJK is ~0.7 chars/token, on English ~4.5, on repeated runs of one
# character (which merge into long tokens) rarely over 16.
MIN_RATIO = 0.25
MAX_RATIO = 32.0
MAX_MODELS = 256  # model names come from clients


@dataclass(frozen=True, slots=True)
class TokenRatio:
    """One model's learnt figures: characters and UTF-8 bytes per prompt token."""

    chars: float
    bytes: float
    samples: int


class _Model:
    __slots__ = ("bytes_ring", "chars_ring", "estimate", "next", "seen")

    def __init__(self) -> None:
        self.chars_ring: list[float] = []
        self.bytes_ring: list[float] = []
        self.next = 0  # the ring slot the next sample overwrites once full
        self.seen = 0  # samples accepted in all
        self.estimate: TokenRatio | None = None


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


class CharsPerToken:
    """Per-model running median of characters (and bytes) per prompt token.

    Memory is bounded: at most `max_models` models (least recently observed evicted),
    each a ring of `window` pairs of floats. `observe` costs one sort of `window` floats
    (~2 us at 64); `ratio` is one dict lookup."""

    def __init__(
        self,
        *,
        window: int = WINDOW,
        min_samples: int = MIN_SAMPLES,
        min_prompt_chars: int = MIN_PROMPT_CHARS,
        min_ratio: float = MIN_RATIO,
        max_ratio: float = MAX_RATIO,
        max_models: int = MAX_MODELS,
    ) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError("window must be >= 1 and 1 <= min_samples <= window")
        if max_models < 1 or min_prompt_chars < 1:
            raise ValueError("max_models and min_prompt_chars must be >= 1")
        if not 0 < min_ratio < max_ratio:
            raise ValueError("need 0 < min_ratio < max_ratio")
        self.window = window
        self.min_samples = min_samples
        self.min_prompt_chars = min_prompt_chars
        self.min_ratio = min_ratio
        self.max_ratio = max_ratio
        self.max_models = max_models
        self._models: OrderedDict[str, _Model] = OrderedDict()
        self.rejected = 0  # samples refused (too short, absurd ratio, bad counts)

    def observe(self, model: str, chars: int, nbytes: int, prompt_tokens: int) -> bool:
        """One successful response's prompt: its length in characters and UTF-8 bytes (as
        meshd rendered it, the text the estimate is applied to) and the engine's
        usage.prompt_tokens. Returns whether the sample was kept."""
        if chars < self.min_prompt_chars or prompt_tokens < 1 or nbytes < chars:
            self.rejected += 1
            return False
        rc = chars / prompt_tokens
        rb = nbytes / prompt_tokens
        if not self.min_ratio <= rc <= self.max_ratio:  # rb is 1-4x rc: bounded with it
            self.rejected += 1
            return False
        models = self._models
        m = models.get(model)
        if m is None:
            if len(models) >= self.max_models:
                models.popitem(last=False)
            m = models[model] = _Model()
        else:
            models.move_to_end(model)
        if len(m.chars_ring) < self.window:
            m.chars_ring.append(rc)
            m.bytes_ring.append(rb)
        else:
            m.chars_ring[m.next] = rc
            m.bytes_ring[m.next] = rb
            m.next = (m.next + 1) % self.window
        m.seen += 1
        if len(m.chars_ring) >= self.min_samples:
            m.estimate = TokenRatio(_median(m.chars_ring), _median(m.bytes_ring), m.seen)
        return True

    def ratio(self, model: str) -> TokenRatio | None:
        """The model's learnt figures, or None before `min_samples` samples."""
        m = self._models.get(model)
        return None if m is None else m.estimate

    def prompt_tokens(self, model: str, prompt_text: str) -> int:
        """The prompt's estimated token count: the learnt ratio, else CHARS_PER_TOKEN."""
        r = self.ratio(model)
        return estimate_prompt_tokens(prompt_text, None if r is None else r.chars)

    def snapshot(self) -> dict[str, dict[str, float | int | None]]:
        """Model -> learnt figures (None until learnt), for /endpoints."""
        out: dict[str, dict[str, float | int | None]] = {}
        for name, m in self._models.items():
            e = m.estimate
            out[name] = {
                "chars_per_token": None if e is None else round(e.chars, 4),
                "bytes_per_token": None if e is None else round(e.bytes, 4),
                "samples": m.seen,
            }
        return out


def pick_inputs(
    learnt: CharsPerToken | None,
    model: str,
    block_size_bytes: int,
    tokens_per_block: float | None,
) -> tuple[float | None, float | None]:
    """(chars_per_token, tokens_per_block) for PickRequest.build: the model's learnt ratio,
    and for meshd's text blocks (`tokens_per_block` None) the block size in tokens its
    learnt bytes per token give; engine token blocks keep theirs. Before the learner has a
    ratio (or without one): (None, tokens_per_block)."""
    ratio = None if learnt is None else learnt.ratio(model)
    if ratio is None:
        return None, tokens_per_block
    if tokens_per_block is None:
        tokens_per_block = block_size_bytes / ratio.bytes
    return ratio.chars, tokens_per_block


def utf8_length(text: str) -> int:
    """len(text.encode()), without the copy for ASCII text (str.isascii is O(1))."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
