"""A request's output text, token by token: each token decodes a short window, never the whole output again."""
from __future__ import annotations


class Detokenizer:
    """Appends tokens and gives the text each adds (vLLM's incremental scheme): the window from `prefix` to the
    end is decoded, and the text past the window's first `read - prefix` tokens is new. A window's text ending in
    an incomplete UTF-8 character (U+FFFD) waits for the next token. Stop strings cut the text where the first
    one begins; they are looked for only in the text that can hold a new match."""

    def __init__(self, tokenizer, stops: list[str] = ()):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0
        self._longest_stop = max((len(s) for s in self.stops), default=0)

    def add(self, token: int, check_stops: bool = True) -> tuple[str, bool]:
        """(text the token adds, whether a stop string ended the text); `check_stops` False (before min_tokens)
        looks for none."""
        self.ids.append(token)
        if self.tokenizer is None:
            return "", False
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        window = decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return "", False
        new = window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        if check_stops and self.stops:
            start = max(len(self.text) - self._longest_stop + 1, 0)
            text = self.text + new
            hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                cut = min(hits)
                new, self.text = text[len(self.text):cut], text[:cut]
                return new, True
        self.text += new
        return new, False
