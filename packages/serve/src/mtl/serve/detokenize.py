"""A request's text as its tokens arrive: the deltas a stream may send, and its stop strings.

The new tokens are decoded after a few prompt tokens and that decoded context is dropped, so
what depends on context (a word tokenizer's spaces, a byte-level token finishing a character
the prompt began) comes out as it would in the whole text. A delta holds back an unfinished
character (U+FFFD at the end) and the text that could still become a stop string."""

from __future__ import annotations

_CONTEXT_TOKENS = 4  # prompt tokens decoded before the new ones


class TextStream:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.context_text = tokenizer.decode(self.context)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of text already given out
        self.stopped = False

    def update(self, new_ids: list[int]) -> None:
        """Decode the request's new tokens so far; ``stopped`` when a stop string appeared (the
        text then ends before it)."""
        whole = self.tokenizer.decode(self.context + list(new_ids))
        text = whole[len(self.context_text):] if whole.startswith(self.context_text) \
            else self.tokenizer.decode(list(new_ids))
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            text, self.stopped = text[: min(cuts)], True
        self.text = text

    def delta(self, final: bool) -> str:
        """Text not given out yet; until ``final``, less what may still change."""
        end = len(self.text)
        if not final:
            end -= self.holdback
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece
