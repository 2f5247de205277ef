"""ResultBuilder: gaps are errors; a stream rewritten after Redis lost writes is accepted when
it repeats what was read, and only what is new is handed out."""

from __future__ import annotations

import pytest

from pagedq.client import StreamGapError
from pagedq.client.protocol import FINISHED, TOKENS, Event
from pagedq.client.result_builder import ResultBuilder


def tokens(seq, ids, position, text=None, reason=None):
    return Event(TOKENS, "r", seq=seq, token_ids=ids, position=position,
                 text="".join(chr(97 + t) for t in ids) if text is None else text,
                 finish_reason=reason)


def fold(builder, events):
    new = []
    for ev in events:
        if builder.feed(ev):
            new.append((ev.seq, list(ev.token_ids), ev.text))
    return new


def test_a_rewritten_stream_that_repeats_what_was_read_is_accepted():
    b = ResultBuilder("r")
    read = fold(b, [tokens(1, [1, 2], 2), tokens(2, [3], 3), tokens(3, [4, 5], 5)])
    # Redis lost seq 2 and 3; the worker resumed at position 2 and wrote them again, merged
    rewritten = fold(b, [tokens(2, [3, 4, 5, 6], 6), tokens(3, [7], 7, reason="length"),
                         Event(FINISHED, "r", seq=4, finish_reasons=["length"])])
    assert [t for _, ids, _ in read + rewritten for t in ids] == [1, 2, 3, 4, 5, 6, 7]
    assert rewritten[0] == (2, [6], "g")  # only what is new is handed out
    res = b.result()
    assert res.token_ids == [1, 2, 3, 4, 5, 6, 7] and res.text == "bcdefgh"
    assert res.finish_reason == "length"


def test_a_rewritten_event_wholly_read_already_hands_out_nothing():
    b = ResultBuilder("r")
    fold(b, [tokens(1, [1], 1), tokens(2, [2], 2), tokens(3, [3], 3)])
    assert fold(b, [tokens(2, [2], 2), tokens(3, [3], 3), tokens(4, [4], 4)]) == [(4, [4], "e")]


@pytest.mark.parametrize("rewrite", [
    tokens(2, [9, 4], 4),  # other tokens
    tokens(2, [3, 4], 4, text="XX"),  # other text
    tokens(4, [6], 6),  # a gap in seq
    tokens(3, [6], 6),  # a gap in positions
])
def test_a_rewrite_that_differs_or_skips_is_an_error(rewrite):
    b = ResultBuilder("r")
    fold(b, [tokens(1, [1, 2], 2), tokens(2, [3, 4], 4)])
    with pytest.raises(StreamGapError):
        b.feed(rewrite)
