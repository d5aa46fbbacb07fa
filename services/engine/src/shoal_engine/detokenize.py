"""A request's output text, detokenized incrementally from the end of its context only.

vLLM's front end primes each request's incremental detokenizer with the whole prompt
(``DecodeStream(ids=prompt)``) when the request is added, before the engine core sees it. That
costs time in proportion to the context. A migrated request is admitted on its target with its
whole context (prompt plus the outputs so far), so this cost sat in the client's stall and grew
with the context (``docs/benchmarks.md`` times the stall against context length).

Owning the text fixes two things more, both on a moved request's way:

* A ``DecodeStream`` primed with a context whose last token ends part-way through a character
  (an output so far that stops inside a CJK character or an emoji, whose bytes BPE splits over
  tokens) emits the whole context's text again with the character's completion (tokenizers
  0.23): the client would see its prompt and output repeated. Here the character comes out once.
* vLLM holds back the last characters of the text while they could still begin a stop string
  (the longest one's length less one). A request stopped for a move never showed them, and its
  target started from nothing: they were lost, and a stop string across the move went unseen.
  Here the stop strings are the engine's (``StopStrings``), and the target starts holding the
  same characters back (``StopStrings.resumed``).

``OutputText`` is the usual incremental scheme (Hugging Face's text-generation-inference, vLLM's
older detokenizer): the text a token adds is the decoded ``ids[p:]`` less what has shown of it,
``ids`` starting at a recent offset ``p``, and every whole character shows with the token that
completes it (an incomplete one decodes to "\ufffd" and waits for its bytes). Decoding a few
tokens before the new ones gives byte-level BPE (GPT-2, SmolLM2) the bytes of a character split
over tokens and SentencePiece-style decoders (Llama's ``Strip``, its leading-space marker) the
same first token to treat apart in both decodes, so priming with the last ``PRIME_TOKENS`` tokens
of the context gives the text a decode of the whole context would. What has shown after any
token is then the decoded text so far less a trailing incomplete character, however the tokens
came in pieces: an engine a request resumes on knows what its client has seen. The backend asks
vLLM for token ids only (``SamplingParams.detokenize=False``) wherever the tokenizer is a fast one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

PRIME_TOKENS = 32
"""Context tokens the decoder starts from: well past the few a token's text depends on (a
character's bytes, a word's pieces)."""

INCOMPLETE = "\ufffd"
"""What a decoder makes of the bytes of a character not yet complete."""


class OutputText:
    """The text of a request's output tokens, piece by piece, with special tokens left out
    (``skip_special_tokens``, vLLM's default; Shoal's requests ask for nothing else). Every
    whole character shows with the token that completes it, so what has shown after any token
    is the decoded text so far less a character not yet complete, whatever the pieces were:
    an engine a request resumes on knows what its client has seen."""

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        # The window of tokens decoded at each step (it starts at the offset ``p`` of the module
        # docstring), and how much of its text has shown: all but a character the context
        # left incomplete, which shows with the token that completes it.
        self._ids = list(context[-PRIME_TOKENS:])
        self._shown = 0
        if self._ids:
            try:
                self._shown = len(self._decode(self._ids).rstrip(INCOMPLETE))
            except (OverflowError, TypeError) as exc:
                logger.warning("cannot decode the context's last tokens (%s): starting without them", exc)
                self._ids = []

    def add(self, token_ids: Sequence[int], stopped: bool = False) -> str:
        """The text ``token_ids``, the request's next output tokens, add. ``stopped``: the last
        of them ended the request (end of sequence or a stop token id), and its text is left
        out, as vLLM leaves it out."""
        if stopped:
            token_ids = token_ids[:-1]
        return "".join([self._step(token_id) for token_id in token_ids])

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        try:
            text = self._decode(self._ids)
        except (OverflowError, TypeError) as exc:  # an id no tokenizer has (vLLM saw such)
            logger.warning("cannot decode token id %s (%s): its text is left out", token_id, exc)
            self._ids.pop()
            return ""
        whole = text.rstrip(INCOMPLETE)
        added = whole[self._shown :]
        if len(whole) == len(text):  # nothing incomplete: the next window starts at this token
            del self._ids[:-1]
            self._shown = len(self._decode(self._ids))
        else:
            self._shown = max(self._shown, len(whole))
        return added

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


class StopStrings:
    """A request's stop strings, matched on ``OutputText``'s text as vLLM matches them on its
    own: the text that could still be the start of a stop string is held back (the longest
    one's length less one characters), the first stop string in the list that the new text
    completes ends the request, and neither it nor anything after it is shown.

    A request resumed here (moved, or sent again after its engine died) starts with the text it
    had held back where it ran before (``resumed``): it comes out here, so a move loses none of
    the text, and a stop string across the move still matches.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must not be empty")
        self._stops = list(stops)
        self.keep = max(len(stop) for stop in self._stops) - 1
        self._pending = ""

    @classmethod
    def resumed(
        cls, stops: Sequence[str], tokenizer: Tokenizer, context: Sequence[int], produced: int
    ) -> StopStrings:
        """The matcher of a request whose ``context`` ends with the ``produced`` output tokens
        it has already, holding back the text it held back then."""
        matcher = cls(stops)
        matcher._pending = held_back(tokenizer, context, produced, matcher.keep)
        return matcher

    def add(self, text: str) -> tuple[str, str | None]:
        """The text to show now of ``text``, the output's next text, and the stop string it
        completed (None: none, the request goes on)."""
        pending = self._pending + text
        for stop in self._stops:
            # A match ends in the new text: it starts at most len(stop) - 1 characters before.
            found = pending.find(stop, max(len(pending) - len(text) - len(stop) + 1, 0))
            if found != -1:
                self._pending = ""
                return pending[:found], stop
        cut = max(len(pending) - self.keep, 0)
        shown, self._pending = pending[:cut], pending[cut:]
        return shown, None

    def flush(self) -> str:
        """The text held back, for the request's last output (it ended without a stop string)."""
        shown, self._pending = self._pending, ""
        return shown


def held_back(tokenizer: Tokenizer, context: Sequence[int], produced: int, keep: int) -> str:
    """The text ``StopStrings`` held back of a request resumed with ``context`` (its prompt,
    then its ``produced`` output tokens): the last ``keep`` characters of its output's text.
    Decodes only as many of the last output tokens as those characters need."""
    if not keep or not produced:
        return ""
    tokens = min(produced, keep + 8)
    while True:
        start = len(context) - tokens
        text = OutputText(tokenizer, context[:start]).add(context[start:])
        if len(text) >= keep or tokens == produced:
            return text[-keep:]
        tokens = min(produced, tokens * 2)
