"""The engine's ``OutputText`` on the real tokenizers of the models Shoal serves here (SmolLM2's
byte-level BPE and the tiny Llama's SentencePiece pieces with byte fallback): after every piece,
the text a decode of everything gives, and the text vLLM's front end makes where the context
ends on a whole character."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.integration.support import MODELS
from tests.unit.test_detokenize import CORPUS, check_every_cut

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", "tiny-llama"])
def test_the_models_tokenizers_give_vllms_text(model: str) -> None:
    tokenizer = Tokenizer.from_file(str(MODELS / model / "tokenizer.json"))
    assert check_every_cut(tokenizer, tokenizer.encode(" ".join(CORPUS * 3)).ids, 16) > 100
