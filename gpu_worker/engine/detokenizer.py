"""Incremental detokenization and stop strings for one sequence.

Text is decoded over a sliding window of output tokens (vLLM's prefix/read offsets), so each step costs
O(window), and a delta ending in U+FFFD (a multi-byte character still incomplete) is held back. Text that
could still become a stop string is held back too, so a stop string never reaches the client.
"""

from __future__ import annotations

from services.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], prompt_tail: list[int] | None = None):
        """`prompt_tail`: the prompt's last few tokens, decoded as context only, so that tokenizers which
        drop a leading space at the start of a decode (SentencePiece) keep the first token's space."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = list(prompt_tail or [])
        self.text = ""
        self.emitted = 0
        self._prefix_offset = 0
        self._read_offset = len(self.token_ids)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any (the text is cut before it)."""
        self.token_ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.token_ids[self._prefix_offset:self._read_offset])
        new_text = self.tokenizer.decode(self.token_ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._cut_at_stop(searched_from)

    def _cut_at_stop(self, start: int) -> str | None:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index]
        return stop

    def skip(self, token_ids: list[int], text_emitted: int) -> None:
        """Replay tokens whose text (its first `text_emitted` characters) was already handed out."""
        for token_id in token_ids:
            self.add_token(token_id)
        self.emitted = min(text_emitted, len(self.text))

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back what may still start a stop string."""
        end = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
