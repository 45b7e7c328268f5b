"""A request's text as its tokens arrive: the deltas a stream may send, and its stop strings.

Decoding is incremental (the scheme of TGI and vLLM), so a step costs the same at token 10
and token 10,000: only a window of ids is decoded, from ``prefix`` (the first id of the
text given out last time) to the end. Its text minus the text of ``prefix .. read`` (the ids
already given out) is what the new ids add; the ids before the window never enter a decode
again. Decoding one earlier id with the new ones keeps what depends on context (a word
tokenizer's spaces, SentencePiece's dropped leading space) as in the whole text. New text
that ends in U+FFFD is held, ids and all, until a later id completes its UTF-8 character;
the end of the request gives out whatever is held. The window starts on a few prompt ids;
a character that the prompt cuts and the first new id completes is new text.

Stop strings are looked for in the text not yet given out, which keeps the last
``len(longest stop) - 1`` characters back: a stop string is never split by a delta."""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt ids that open the first window (vLLM's choice)
_INCOMPLETE = "\ufffd"  # what a cut UTF-8 character decodes to


class IncrementalDecoder:
    """Token ids in, the text they add out; ``flush`` at the end gives out what is held."""

    def __init__(self, tokenizer, context_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(context_ids[-_CONTEXT_TOKENS:])  # from the window's first id on
        self.read = len(self.ids)  # ids before this one have given out their text
        self.read_text = tokenizer.decode(self.ids)  # the text of ids[:read]

    def add(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        text = self.tokenizer.decode(self.ids)
        if len(text) <= self._new_text_start(text) or text.endswith(_INCOMPLETE):
            return ""  # nothing new yet, or a character still cut: wait for the next ids
        return self._advance(text)

    def flush(self) -> str:
        """The held text (an unfinished character becomes U+FFFD, as decoding the whole does)."""
        text = self.tokenizer.decode(self.ids)
        return self._advance(text) if len(text) > self._new_text_start(text) else ""

    def _new_text_start(self, text: str) -> int:
        """Where the text of the new ids begins: after ``read_text``; or, where the window's
        text no longer starts with it, where the two part. That happens when the prompt ends
        in a cut character (U+FFFD) that the first new id completes: the character is new."""
        if text.startswith(self.read_text):
            return len(self.read_text)
        return next((i for i, (a, b) in enumerate(zip(text, self.read_text)) if a != b), len(text))

    def _advance(self, text: str) -> str:
        delta = text[self._new_text_start(text):]
        # the next window opens on the ids just given out: their text gives the next ones context
        self.ids = self.ids[self.read:]
        self.read = len(self.ids)
        self.read_text = self.tokenizer.decode(self.ids)
        return delta


class TextStream:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...]):
        self.decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.pending = ""  # decoded, not given out: where a stop string may still appear
        self.stopped = False

    def update(self, new_ids: list[int], final: bool = False) -> None:
        """Take the request's newest ids (``final``: it ends with them); ``stopped`` when a stop
        string appeared (the text then ends before it)."""
        if self.stopped:
            return
        self.pending += self.decoder.add(new_ids)
        if final:
            self.pending += self.decoder.flush()
        cuts = [self.pending.find(s) for s in self.stop if s in self.pending]
        if cuts:
            self.pending, self.stopped = self.pending[: min(cuts)], True

    def delta(self, final: bool) -> str:
        """Text not given out yet; until ``final``, less what may still become a stop string."""
        keep = 0 if final or self.stopped else self.holdback
        if len(self.pending) <= keep:
            return ""
        cut = len(self.pending) - keep
        piece, self.pending = self.pending[:cut], self.pending[cut:]
        return piece
