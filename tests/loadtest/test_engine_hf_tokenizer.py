"""The optional real tokenizer (a `tokenizers` tokenizer.json) keeps the continuation rule."""

from __future__ import annotations

from pathlib import Path

import pytest
from sim_helpers import FAST

from loadtest.engine.core import CoreConfig, EngineCore, SimRequest, run_until_idle
from loadtest.engine.profiles import get_profile
from loadtest.engine.tokenizer import GEN_WORDS, TokenGenerator, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")


def _train(path: Path) -> None:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, special_tokens=["[UNK]"])
    corpus = [" ".join(GEN_WORDS[i : i + 20]) for i in range(0, len(GEN_WORDS), 5)] * 5
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))


def test_hf_tokenizer_continuation(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    _train(path)
    tok = load_tokenizer(str(path))
    assert FAST > 0

    def generate(text: str, n: int) -> list[str]:
        core = EngineCore(CoreConfig(profile=get_profile("H100")), TokenGenerator(tok))
        req = SimRequest("r", tok.encode(text), n)
        core.submit(req, 0.0)
        run_until_idle(core)
        return req.output_pieces

    full = generate("the river and the sea", 20)
    assert len(full) == 20
    assert generate("the river and the sea" + "".join(full[:8]), 12) == full[8:]
