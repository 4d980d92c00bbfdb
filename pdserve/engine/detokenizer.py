"""Incremental detokenization and stop-string detection for one sequence.

Text is produced by decoding a short window of tokens and emitting what the window's last token
added; a window that ends inside a multi-byte character decodes to U+FFFD and waits for more."""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool,
                 stop: tuple[str, ...]):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stop = stop
        self.ids: list[int] = list(prompt_ids[-6:])  # a little context so leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.reported = 0             # characters of text already handed out
        self._held = max((len(s) for s in stop), default=1) - 1  # tail withheld while a stop may match

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if the text now contains one (the text is
        then cut before it). When several stop strings appear, the one that starts first in the
        text is the one reported and cut at (so the text contains none of them), whatever their
        order in ``stop``; of two starting at the same place, the earlier listed."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            # a stop string not found before ends in the new text, so it starts at most
            # len(stop) - 1 characters before it
            start = max(0, len(self.text) - self._held)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            found = [(j, i) for i, s in enumerate(self.stop)
                     if (j := self.text.find(s, start)) >= 0]
            if found:
                j, i = min(found)
                self.text = self.text[:j]
                return self.stop[i]
        return None

    def take_new_text(self, finished: bool) -> str:
        """Text not yet reported; while running, keeps back a tail that could begin a stop string."""
        end = len(self.text) if finished else max(self.reported, len(self.text) - self._held)
        new = self.text[self.reported:end]
        self.reported = end
        return new
