"""The engine's ``OutputText`` on the real tokenizers of the models Shoal serves here (SmolLM2's
byte-level BPE and the tiny Llama's SentencePiece pieces with byte fallback): after every piece,
the text a decode of everything gives, and the text vLLM's front end makes where the context
ends on a whole character."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from shoal_engine.detokenize import OutputText
from tests.integration.support import MODELS
from tests.unit.test_detokenize import CORPUS, INCOMPLETE, complete, steps, truth, vllms_way

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", "tiny-llama"])
def test_the_models_tokenizers_give_vllms_text(model: str) -> None:
    tokenizer = Tokenizer.from_file(str(MODELS / model / "tokenizer.json"))
    ids = tokenizer.encode(" ".join(CORPUS * 3)).ids
    rng = random.Random(1)
    for cut in range(1, len(ids) - 16):
        context, rest = ids[:cut], ids[cut : cut + 16]
        pieces = steps(rng, rest)
        text = OutputText(tokenizer, context)
        got, done = [], 0
        for piece in pieces:
            got.append(text.add(piece))
            done += len(piece)
            assert "".join(got) == complete(truth(tokenizer, context, rest[:done])), (cut, done)
        if not tokenizer.decode(context, skip_special_tokens=True).endswith(INCOMPLETE):
            theirs = "".join(vllms_way(tokenizer, context, pieces))
            assert "".join(got).startswith(theirs), cut
            if not truth(tokenizer, context, rest).endswith(INCOMPLETE):
                assert "".join(got) == theirs, cut
