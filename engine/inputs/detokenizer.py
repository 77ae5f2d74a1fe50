"""A completion's text, decoded as its tokens come, with its stop strings found in the same pass.

Each step decodes only a small window: the tokens of the last piece (as context: a token's text can
depend on its neighbours, e.g. the bytes of one character split over tokens, or a leading space dropped
at the start) and the new ones. A piece is taken only when the window's text does not end in an
incomplete character; until then the window grows. Stop strings are looked for in the new text and the
`longest stop - 1` characters before it, and that tail is held back from the caller until no stop string
can start in it, so no text past a stop is ever handed out. The pieces concatenate to the text a single
decode of the whole completion gives.
"""
from __future__ import annotations

import copy

INCOMPLETE = "\ufffd"  # what decode gives for an incomplete UTF-8 sequence at the end


class Detokenizer:
    """One sequence's text. `update` as tokens come, `finish` once it ended, `take` for the new text."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.holdback = max(map(len, self.stop), default=1) - 1  # a stop string may start this far back
        self.text = ""          # the stable text so far; cut before the stop string once one is found
        self.prefix = 0         # completion[prefix:read]: the last piece's tokens, decoded as context
        self.read = 0
        self.fed = 0            # completion tokens taken
        self.context = ""       # the text of completion[prefix:read] (None: not decoded yet)
        self.searched = 0       # text[:searched] was searched for stop strings
        self.reported = 0       # text[:reported] was handed out by take()
        self.stopped = False    # a stop string ended the text
        self.finished = False
        self.num_decoded_tokens = 0  # tokens passed to decode in all (a step's cost; tests read it)
        self.num_searched_chars = 0  # characters searched for stop strings in all

    def fork(self) -> "Detokenizer":
        return copy.copy(self)

    def update(self, completion: list[int], end: int, find_stop: bool) -> bool:
        """Take completion[fed:end]; find_stop: look for the stop strings in the new text. True when a stop
        string was found (the text is cut before it)."""
        if self.stopped or end <= self.fed:
            return self.stopped
        self.fed = end
        if self.context is None:
            self.context = self._decode(completion, self.prefix, self.read)
        window = self._decode(completion, self.prefix, end)
        if len(window) > len(self.context) and not window.endswith(INCOMPLETE):
            self.text += window[len(self.context):]
            self.prefix, self.read, self.context = self.read, end, None
        return find_stop and bool(self.stop) and self._find_stop()

    def finish(self, completion: list[int], end: int) -> None:
        """The sequence ended with completion[:end] as its text's tokens: take the rest, held back or not."""
        if self.finished:
            return
        self.finished = True
        if self.stopped or end <= self.read:
            return
        if self.context is None:
            self.context = self._decode(completion, self.prefix, self.read)
        self.text += self._decode(completion, self.prefix, end)[len(self.context):]
        self.fed = self.read = end

    def take(self) -> str:
        """The text not handed out yet that no stop string can still cut."""
        end = len(self.text)
        if self.stop and not (self.finished or self.stopped):
            end = max(self.searched - self.holdback, self.reported)
        piece, self.reported = self.text[self.reported:end], end
        return piece

    def _find_stop(self) -> bool:
        start = max(self.searched - self.holdback, 0)
        window = self.text[start:]
        self.num_searched_chars += len(window)
        self.searched = len(self.text)
        found = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        if not found:
            return False
        self.text = self.text[: start + min(found)]
        self.stopped = True
        return True

    def _decode(self, completion: list[int], start: int, end: int) -> str:
        self.num_decoded_tokens += end - start
        return self.tokenizer.decode(completion[start:end], skip_special_tokens=True)
