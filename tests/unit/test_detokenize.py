"""``OutputText`` and ``StopStrings``, the engine's own text and stop strings, primed with the end
of a request's context only, on tokenizers of both kinds trained here on text with multi-byte
characters: byte-level BPE (GPT-2, SmolLM2) and SentencePiece-style pieces with byte fallback
(Llama). After every piece the text shown is a decode of everything's (and vLLM's, where the
context ends on a whole character); a request moved after any token shows the same text and
stops at the same stop string as one that never moved."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream

from shoal_engine.detokenize import INCOMPLETE, PRIME_TOKENS, OutputText, StopStrings

CORPUS = [
    "Shoal moves a decoding request between engines while its stream goes on.",
    "Les requêtes migrent d'un moteur à l'autre ; le client ne voit qu'un léger écart.",
    "请求在引擎之间迁移\uff0c客户端只看到一次稍长的停顿。",
    "リクエストはエンジン間を移動します。🐟🐠🐡 def f(x):\n    return x ** 2\n",
    "Ünïcödé wörds, naïve café, \U0001d518\U0001d52b\U0001d526 and emoji 👩\u200d👩\u200d👧 in one line.",
]
EOS = "</s>"


def byte_level() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    return tokenizer


def sentencepiece_like() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    # Byte tokens for what the merges do not cover (the CJK and emoji, byte by byte).
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<unk>", EOS, *bytes_])
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    tokenizer.add_special_tokens([AddedToken(EOS, special=True)])
    return tokenizer


def vllms_way(tokenizer: Tokenizer, context: list[int], outputs: list[list[int]]) -> list[str]:
    """The pieces a decoder primed with the whole context gives (vLLM's front end)."""
    stream = DecodeStream(ids=context, skip_special_tokens=True)
    return ["".join(stream.step(tokenizer, t) or "" for t in piece) for piece in outputs]


def complete(text: str) -> str:
    return text.rstrip(INCOMPLETE)


def truth(tokenizer: Tokenizer, context: list[int], outputs: list[int]) -> str:
    """The outputs' text from a decode of everything: what follows the context's text (less
    a character it leaves incomplete)."""
    whole = tokenizer.decode(context + outputs, skip_special_tokens=True)
    return whole[len(complete(tokenizer.decode(context, skip_special_tokens=True))) :]


def steps(rng: random.Random, ids: list[int]) -> list[list[int]]:
    """``ids`` in pieces of one to three tokens, as engine steps deliver them."""
    pieces, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 3)
        pieces.append(ids[start : start + size])
        start += size
    return pieces


@pytest.fixture(params=["byte_level", "sentencepiece_like"], scope="module")
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    built: Tokenizer = byte_level() if request.param == "byte_level" else sentencepiece_like()
    return built


def check_every_cut(tokenizer: Tokenizer, ids: list[int], outputs: int) -> int:
    """Run ``OutputText`` over ``outputs`` tokens after every cut of ``ids`` (some inside a
    character's bytes, some inside words), in pieces of one to three tokens, and check the text;
    returns how many contexts ended on a whole character."""
    rng = random.Random(0)
    clean_cuts = 0
    for cut in range(1, len(ids) - outputs):
        context, rest = ids[:cut], ids[cut : cut + outputs]
        pieces = steps(rng, rest)
        text = OutputText(tokenizer, context)
        got, done = [], 0
        for piece in pieces:
            got.append(text.add(piece))
            done += len(piece)
            # Never a wrong character, never one twice, none late: what has shown is the text of
            # everything so far, less a character not yet complete.
            assert "".join(got) == complete(truth(tokenizer, context, rest[:done])), (cut, done)
        if not tokenizer.decode(context, skip_special_tokens=True).endswith(INCOMPLETE):
            # Where the context ends on a whole character, the text vLLM shows (which holds a
            # whole character back while the token that completes it starts another).
            clean_cuts += 1
            theirs = "".join(vllms_way(tokenizer, context, pieces))
            assert "".join(got).startswith(theirs), cut
            if not truth(tokenizer, context, rest).endswith(INCOMPLETE):
                assert "".join(got) == theirs, cut
    return clean_cuts


def test_the_text_shown_is_a_whole_decodes_after_every_piece_wherever_the_context_ends(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode(" ".join(CORPUS * 4)).ids
    assert len(ids) > 4 * PRIME_TOKENS
    clean_cuts = check_every_cut(tokenizer, ids, 24)
    assert clean_cuts > 100


def test_a_character_the_context_left_incomplete_shows_once_where_vllms_decoder_repeats_the_context() -> None:
    tokenizer = byte_level()
    ids = tokenizer.encode("Shoal 请求在引擎之间迁移 🐟").ids
    cuts = [c for c in range(1, len(ids)) if tokenizer.decode(ids[:c]).endswith(INCOMPLETE)]
    assert cuts, "no token boundary inside a character"
    for cut in cuts:
        context, rest = ids[:cut], ids[cut:]
        text = OutputText(tokenizer, context)
        shown = "".join(text.add([t]) for t in rest)
        assert shown == truth(tokenizer, context, rest)
        assert tokenizer.decode(ids) == complete(tokenizer.decode(context)) + shown
        # A decoder primed with such a context shows the context's text again (tokenizers 0.23):
        # a migrated request would repeat its prompt and output to the client.
        repeated = "".join(vllms_way(tokenizer, context, [[t] for t in rest]))
        assert repeated.startswith("Shoal"), repeated


def test_the_text_of_a_short_context_and_of_none(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(CORPUS[3]).ids
    for cut in range(0, 6):
        text = OutputText(tokenizer, ids[:cut])
        got = "".join(text.add([t]) for t in ids[cut:])
        assert got == truth(tokenizer, ids[:cut], ids[cut:])


def test_a_request_that_stopped_leaves_its_last_tokens_text_out(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" ".join(CORPUS)).ids
    eos = tokenizer.token_to_id(EOS)
    # A stop token id of ordinary text ends the request: its text is not the request's.
    assert OutputText(tokenizer, ids[:5]).add(ids[5:8], stopped=True) == truth(tokenizer, ids[:5], ids[5:7])
    assert OutputText(tokenizer, ids[:5]).add([ids[5], eos], stopped=True) == truth(
        tokenizer, ids[:5], ids[5:6]
    )
    assert OutputText(tokenizer, ids[:5]).add([eos], stopped=True) == ""


def test_special_tokens_have_no_text_and_an_id_out_of_range_costs_only_its_own(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" ".join(CORPUS)).ids
    text = OutputText(tokenizer, ids[:10])
    assert text.add([tokenizer.token_to_id(EOS)]) == ""
    assert text.add([2**40]) == ""  # no tokenizer has it: logged, and left out
    assert text.add(ids[10:14]) == truth(tokenizer, ids[:10], ids[10:14])


# ---- stop strings --------------------------------------------------------------------------


def test_stop_strings_hold_back_what_could_start_one_and_end_at_the_first_in_the_list() -> None:
    stops = StopStrings(["END", "\n\n"])
    assert stops.keep == 2
    assert stops.add("abc") == ("a", None)  # "bc" could start neither... but is as long as one could
    assert stops.add("E") == ("b", None)
    assert stops.add("N") == ("c", None)
    assert stops.add("Dxyz\n\n") == ("", "END")  # nothing after the match shows, nor the match
    other = StopStrings(["\n\n", "END"])
    assert other.add("x\n\nEND") == ("x", "\n\n")  # the list's order, as vLLM's
    with pytest.raises(ValueError, match="must not be empty"):
        StopStrings(["END", ""])  # as vLLM refuses it: the request's fault
    last = StopStrings(["END"])
    assert last.add("no stop here") == ("no stop he", None)
    assert last.flush() == "re" and last.flush() == ""


def _serve(
    tokenizer: Tokenizer, context: list[int], outputs: list[int], stops: StopStrings
) -> tuple[list[str], str | None]:
    """What an engine shows of ``outputs`` one token at a time, and the stop string matched."""
    text, shown = OutputText(tokenizer, context), []
    for i, token in enumerate(outputs):
        piece, matched = stops.add(text.add([token]))
        shown.append(piece)
        if matched is not None:
            return shown, matched
        if i == len(outputs) - 1:
            shown.append(stops.flush())
    return shown, None


@pytest.mark.parametrize("stop", ["迁移", "moves a", "\U0001f41f", "never there"])
def test_a_request_moved_anywhere_shows_the_text_and_stops_where_it_would_have(
    tokenizer: Tokenizer, stop: str
) -> None:
    ids = tokenizer.encode(" ".join(CORPUS)).ids
    prompt, outputs = ids[:6], ids[6:90]
    unmoved, matched = _serve(tokenizer, prompt, outputs, StopStrings([stop, "zz"]))
    assert (matched is not None) == (stop in tokenizer.decode(outputs))
    for k in range(1, len(outputs)):
        # The source ran the first k tokens (it stops for the move: no flush), the target the rest.
        source, text = StopStrings([stop, "zz"]), OutputText(tokenizer, prompt)
        shown, ended = [], None
        for token in outputs[:k]:
            piece, ended = source.add(text.add([token]))
            shown.append(piece)
            if ended is not None:
                break
        if ended is not None:
            continue  # it stopped before the move
        context = prompt + outputs[:k]
        target = StopStrings.resumed([stop, "zz"], tokenizer, context, produced=k)
        after, ended = _serve(tokenizer, context, outputs[k:], target)
        assert "".join(shown + after) == "".join(unmoved) and ended == matched, k
