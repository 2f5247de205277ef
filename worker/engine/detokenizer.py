"""Incremental detokenization: turn a growing list of token ids into text deltas.

Re-decoding every output token on every step costs O(n) per step, O(n^2) per request. vLLM's
prefix/read-offset technique decodes only a small window of recent tokens instead:

    window = ids[prefix:]          prefix_text = decode(ids[prefix:read])
                                   full_text   = decode(ids[prefix:])
    delta  = full_text[len(prefix_text):]

Both decodes start at the same token, so tokenizer quirks at the window's start (a SentencePiece
leading space, bytes of a character cut in half) cancel out. A byte-level token may hold only
part of a UTF-8 character; its decode then ends in U+FFFD, and the delta is held back until the
character completes, so a stream never shows a replacement character that the final text won't
have. The window starts a few prompt tokens back so the first output token decodes in context.

Stop strings are matched by the engine on ``text`` with ``find_stop``; ``partial_stop_len`` says
how much of a text's tail might still grow into a stop string (hold it back from a stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "find_stop", "partial_stop_len"]

# Prompt tokens decoded as left context for the first output token (vLLM uses the same 5).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for one output sequence; ``text`` is always the concatenation of the deltas.

    With ``tokenizer=None`` (token-id-only models) every delta is "" and ``text`` stays "".
    """

    def __init__(
        self,
        tokenizer: Any | None,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        # Only ids from the prefix offset on are kept: older ones are never decoded again.
        self._window: list[int] = []
        self._read = 0  # window index of the first token whose text is not emitted yet
        self._prefix_text = ""  # decode(window[:read]), cached between steps
        if tokenizer is not None:
            self._start_window(list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]))

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _start_window(self, context: list[int]) -> None:
        # A prompt that ends mid-character would make every delta look "incomplete"; decode the
        # output on its own then, exactly as tokenizer.decode(output_ids) does.
        prefix_text = self._decode(context)
        if prefix_text.endswith(REPLACEMENT_CHAR):
            context, prefix_text = [], ""
        self._window, self._read, self._prefix_text = context, len(context), prefix_text

    def append(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the newly stable text ("" while a character is partial).

        When several tokens arrive at once, text up to the last token boundary that ends a whole
        character is emitted; ends that an earlier call already found unstable are not retried,
        so one token per step costs one decode (two when text is emitted).
        """
        if self.tokenizer is None or not token_ids:
            return ""
        tried = len(self._window)  # ends up to here were already found unstable
        self._window.extend(token_ids)
        for end in range(len(self._window), tried, -1):
            full_text = self._decode(self._window[:end])
            if not full_text.endswith(REPLACEMENT_CHAR) and len(full_text) > len(self._prefix_text):
                return self._emit(full_text, end)
        return ""  # incomplete character, or only skipped special tokens so far: hold

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD, as decode does).

        Call once when the sequence finishes.
        """
        if self.tokenizer is None or self._read == len(self._window):
            return ""
        full_text = self._decode(self._window)
        if len(full_text) <= len(self._prefix_text):
            return ""
        return self._emit(full_text, len(self._window))

    def _emit(self, full_text: str, end: int) -> str:
        """Emit decode(window[:end]) past the prefix text; slide the window to start at read."""
        delta = full_text[len(self._prefix_text) :]
        self._window = self._window[self._read :]
        self._read = end - self._read
        self._prefix_text = self._decode(self._window[: self._read])
        self.text += delta
        return delta


def find_stop(text: str, start: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends at or after ``start``, as (index, stop).

    ``start`` is where this step's new text begins: earlier text was already searched, so only
    a tail of len(stop) - 1 characters before it is searched again (a stop split across tokens
    or steps is still found). Ties at one index go to the first stop in ``stops``.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        index = text.find(stop, max(0, start - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string.

    A stream should hold those characters back: the next token may complete the stop string,
    and then they are cut from the output.
    """
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
