"""Draft tokens with no draft model: n-gram (prompt lookup) and a corpus of earlier requests.

A decoding sequence whose last few tokens occurred before proposes the tokens that followed
them then. The step verifies the draft as extra query rows (engine.py): a draft token is kept
exactly when it equals the token the sampler draws at its position, so speculation changes how
many tokens a step yields, never which tokens.

- ``ngram_draft``: the most recent earlier occurrence of the sequence's longest suffix of
  ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, in its own prompt and output. The
  search runs over the token ids packed as bytes (``bytes.rfind``, C speed).
- ``SuffixCorpus`` (method "suffix", pagedq.worker.engine.suffix_tree): the prompts and
  outputs of this engine's recent requests (one engine serves one model and its worker one
  queue) in a depth-bounded suffix tree with occurrence counts, least recently used request
  out first. A sequence drafts from whichever of its own tokens (n-gram, measured up to the
  tree's depth) and the tree matches its suffix longer, its own on a tie; the tree's draft
  follows the most frequent continuation of the match. A constrained sequence tries its own
  tokens first (``Drafter._candidates`` says why).
- **Grammar drafts** (structured outputs): a json_schema answer is mostly text the grammar
  forces (``{"``, key names, ``": "``, ``", "``, closing brackets, the stop token once it is
  complete). ``StructuredOutputs.forced_tokens`` walks the sequence's matcher forward over
  xgrammar's jump-forward tokens, and over any position whose mask allows exactly one token,
  stopping at the first choice, then rolls it back. These drafts are guesses like the others:
  the grammar forces the text, not its tokenization (the model may write ``{`` ``"`` where
  xgrammar drafts ``{"``), and verification keeps a token only if the sampler draws it.
- **Spelling lookup** (constrained sequences, ``Drafter._respelt``): a value copied from the
  prompt into JSON is often spelt in other tokens (`` Beirut`` after a space in the prompt,
  ``Be`` ``ir`` ``ut`` after the answer's quote), which no token-id lookup finds; the text of the
  sequence's last tokens is matched in the prompt's text and the text after it re-tokenized.
- ``Drafter``: decides each sequence's draft (its adaptive length, the step's size, the
  request's switch, its grammar) and keeps the acceptance counters. The rule for a sequence
  with a grammar: the forced tokens first (up to ``num_speculative_tokens``, whatever the
  adaptive length: they are nearly always accepted), then the n-gram / suffix lookup over its
  tokens followed by the forced ones, for at most the adaptive length and the remaining room,
  then the whole draft trimmed to the prefix the grammar allows (the first forbidden token
  ends it).
"""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import Any

from pagedq.worker.config import SpeculativeConfig
from pagedq.worker.engine.draft_worth import DraftWorth
from pagedq.worker.engine.sequence import Request, Sequence
from pagedq.worker.engine.spec_governor import SpecGovernor
from pagedq.worker.engine.suffix_tree import SuffixCorpus

_WIDTH = 4  # bytes per token id in the packed search buffer
# Grammar-checked lookup (constrained sequences): how many candidate continuations are tried
# against the grammar, and how many occurrences of one suffix length among them.
CANDIDATES = 8
PER_LENGTH = 3
TEXT_TAIL = 2  # tokens whose text a spelling lookup matches in the prompt's text
TEXT_DRAFT_CHARS = 48  # prompt text after the match that is re-tokenized into a draft
# A sequence's first draft is at most this long; each fully accepted draft lets the next grow
# by one up to num_speculative_tokens (open chat rarely gets there; copying jobs soon do).
FIRST_DRAFT = 4


def _packed(tokens: Tokens[int]) -> bytes:
    return array("I", tokens).tobytes()


def _find_aligned(buf: bytes, pattern: bytes, end: int) -> int:
    """Byte offset of the last token-aligned occurrence of ``pattern`` ending by ``end``."""
    while True:
        i = buf.rfind(pattern, 0, end)
        if i < 0 or i % _WIDTH == 0:
            return i
        end = i + len(pattern) - 1


def extend(source: Tokens[int], start: int, k: int) -> list[int]:
    """``k`` tokens of ``source`` from ``start``; past its end the draft repeats itself (a
    sequence stuck in a loop drafts the loop's next turn)."""
    out: list[int] = []
    for j in range(k):
        idx = start + j
        out.append(source[idx] if idx < len(source) else out[idx - len(source)])
    return out


def ngram_match(tokens: Tokens[int], min_n: int, max_n: int) -> tuple[int, int]:
    """(length of the longest suffix of ``tokens`` of min_n..max_n tokens that occurred earlier,
    index of the token that followed its latest earlier occurrence); (0, -1) when none did.

    Binary search on the length, as the suffix tree's match does: an earlier occurrence of a
    suffix holds one of every shorter suffix, so a few ``rfind`` calls find the longest even
    when ``max_n`` is the tree's depth (24), not prompt lookup's 5."""
    length = len(tokens)
    low, high, best = min_n, min(max_n, length - 1), (0, -1)
    if high < low:
        return best
    buf = _packed(tokens)
    end = len(buf) - _WIDTH  # an occurrence must have a token after it
    while low <= high:
        n = (low + high) // 2
        i = _find_aligned(buf, buf[-n * _WIDTH:], end)
        if i < 0:
            high = n - 1
        else:
            best, low = (n, i // _WIDTH + n), n + 1
    return best


def ngram_occurrences(tokens: Tokens[int], min_n: int, max_n: int,
                      limit: int) -> list[tuple[int, int]]:
    """Up to ``limit`` earlier occurrences of the suffixes of ``tokens`` of max_n down to min_n
    tokens, as (length, index of the token that followed): longer suffixes first, and for each
    length the latest occurrence first (at most ``PER_LENGTH`` of them)."""
    length = len(tokens)
    if length <= min_n:
        return []
    buf = _packed(tokens)
    out: list[tuple[int, int]] = []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        end = len(buf) - _WIDTH
        for _ in range(PER_LENGTH):
            i = _find_aligned(buf, buf[-n * _WIDTH:], end)
            if i < 0:
                break
            out.append((n, i // _WIDTH + n))
            if len(out) >= limit:
                return out
            end = i + n * _WIDTH - 1
    return out


def ngram_draft(tokens: Tokens[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of the
    longest matching suffix of ``tokens`` (an empty list when none matches)."""
    n, start = ngram_match(tokens, min_n, max_n)
    return extend(tokens, start, k) if n else []


@dataclass
class SpecCounters:
    """vLLM's spec_decode_* counters: proposals, their tokens, the tokens accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.append(0)
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    def stats(self) -> dict[str, Any]:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        # mean tokens a verified sequence gained per step: the accepted ones plus the one the
        # step samples anyway (vLLM's "mean acceptance length")
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_acceptance_rate": round(rate, 4),
                "spec_decode_mean_acceptance_length": round(mean, 4),
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}


class Drafter:
    """Each decoding sequence's draft for this step, and what verification made of it.

    ``allowed(seq, draft)`` trims a draft to the prefix its grammar accepts (structured
    outputs); ``forced(seq, k)``, when set (the engine sets StructuredOutputs.forced_tokens),
    gives up to k tokens the grammar forces next; ``max_model_len`` bounds a draft so its rows
    stay inside the context.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 allowed: Callable[[Sequence, list[int]], list[int]] | None = None,
                 forced: Callable[[Sequence, int], list[int]] | None = None,
                 tokenizer: Any = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._prompt_text: weakref.WeakKeyDictionary[Request, str] = weakref.WeakKeyDictionary()
        self.max_model_len = max_model_len
        self.allowed = allowed
        self.forced = forced
        self.corpus = (SuffixCorpus(config.suffix_decoding_max_cached_requests,
                                    config.prompt_lookup_min,
                                    config.suffix_decoding_max_tree_depth)
                       if config.method == "suffix" else None)
        self.counters = SpecCounters()
        self.worth = DraftWorth()  # how deep lookups pay, against the governor's row cost
        # whether a step speculates: measured per batch size, capped (spec_governor.py)
        self.governor = SpecGovernor(config.disable_by_batch_size, config.adaptive)

    def enabled_for(self, num_running: int) -> bool:
        """Whether this step may speculate at all: below ``disable_by_batch_size`` and, with
        ``adaptive``, where speculation has measured faster for batches of this size (the
        engine reports the step's tokens and time back to ``self.governor``)."""
        return self.governor.decide(num_running)

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """The draft of a sequence about to decode (at most ``budget`` tokens); [] for none:
        the tokens its grammar forces, then a lookup continuing them, trimmed to what the
        grammar allows (the module docstring's rule)."""
        req = seq.request
        if req.hook is not None or not getattr(req.params, "speculative", True):
            return []
        top = min(self.config.num_speculative_tokens, budget,
                  self.max_model_len - seq.num_tokens - 1)
        if req.params.max_tokens is not None:  # the last sampled token needs no draft behind it
            top = min(top, req.params.max_tokens - seq.num_generated - 1)
        if top <= 0:
            return []
        forced = self.forced(seq, top) if self.forced is not None else []
        seq.draft_forced = len(forced)
        constrained = self._constrained(req)
        guessed = min(seq.spec_len or min(top, FIRST_DRAFT), top - len(forced))  # the adaptive part
        # ... cut to the lookup depths that pay for their rows at this batch size
        guessed = self.worth.depth(seq.draft_depths, constrained, self.governor.draft_row_cost(),
                                   guessed)
        if guessed <= 0:
            return forced
        tokens = seq.token_ids + forced if forced else seq.token_ids
        if constrained:
            return self._checked(seq, tokens, forced, guessed)
        return forced + self._lookup(tokens, guessed)

    def _constrained(self, req: Request) -> bool:
        """Whether the request's drafts are checked against its grammar."""
        return self.allowed is not None and bool(getattr(req.params, "structured_outputs", None))

    def _checked(self, seq: Sequence, tokens: list[int], forced: list[int],
                 k: int) -> list[int]:
        """A constrained sequence's draft: the forced tokens, then the first lookup candidate
        (longest match first, latest occurrence first, matches down to one token) that its
        grammar allows whole, else the one it allows longest.

        Why not just the longest match: the grammar cuts many of them short. A JSON value is
        copied from the prompt, where a number goes on with " and", an e-mail with ". Skills",
        and the first token of a value is often spelt differently there (" fat" in the prompt,
        "fat" after the opening quote), so the longest match is no match at all and a
        one-token match on the value's first token is the one that continues it. The grammar
        tells which candidates are possible at all (measured on the bench's extraction jobs,
        one stream, forced on: ngram 1.99 -> 2.26, suffix 2.36 -> 2.65 tokens a step)."""
        assert self.allowed is not None
        best = forced
        seen: set[tuple[int, ...]] = set()
        for guess in self._candidates(tokens, k, seq.request):
            if tuple(guess) in seen:
                continue
            seen.add(tuple(guess))
            draft = self.allowed(seq, forced + guess)
            if len(draft) == len(forced) + len(guess):
                return draft
            if len(draft) > len(best):
                best = draft
        return best

    def _candidates(self, tokens: list[int], k: int, req: Request) -> Iterator[list[int]]:
        """Continuations of ``tokens`` (up to ``k`` tokens each) in order of preference: the
        sequence's own n-gram occurrences (longest suffix, then latest, first; matches of one
        token count), then the suffix corpus's draft, then the spelling lookup
        (:meth:`_respelt`); each computed only when no earlier candidate was taken whole.

        Why the corpus after the sequence's own tokens, however long its match: a constrained
        answer's structure is forced by its grammar (those tokens are drafted before any
        lookup), so the lookup drafts values, and a job's values come from its own prompt.
        The corpus matches deeper (earlier jobs wrote the same keys) and then drafts their
        values. Measured on the bench's extraction jobs (48 after 4, one stream, suffix):
        ranked by match length 3.15 tokens a verified step at 0.60 acceptance, own tokens
        first 3.44 at 0.66."""
        for _, start in ngram_occurrences(tokens, 1, self.config.prompt_lookup_max, CANDIDATES):
            yield extend(tokens, start, k)
        if self.corpus is not None:
            _, draft = self.corpus.propose(tokens, k)
            if draft:
                yield draft
        respelt = self._respelt(tokens, k, req)
        if respelt:
            yield respelt

    def _respelt(self, tokens: list[int], k: int, req: Request) -> list[int]:
        """A copy from the prompt matched by text, not by token ids: up to ``k`` tokens.

        Why: a value copied into JSON is spelt in other tokens than in the prompt. The
        record's `` Beirut`` is one token after a space, the answer's ``"Be`` ``ir`` ``ut``
        starts after a quote; the token lookups find nothing after ``Be``. Here the text of
        the last TEXT_TAIL tokens is matched (longest suffix first, at least the whole last
        token) in the prompt's text, and the text after the match is tokenized together
        with the last token's text; the tokens after the last token are the draft, kept only
        when that tokenization starts with the last token itself (the copy continues the
        model's spelling there, else it is unlikely to be the model's next tokens)."""
        tok = self.tokenizer
        if tok is None or len(tokens) <= len(req.prompt_token_ids):
            return []
        text = self._prompt_text.get(req)
        if text is None:
            text = self._prompt_text[req] = tok.decode(req.prompt_token_ids)
        last = tok.decode(tokens[-1:])
        tail = tok.decode(tokens[-TEXT_TAIL:])
        if not last.strip() or not tail.endswith(last):
            return []
        for n in range(len(tail), len(last) - 1, -1):
            at = text.rfind(tail[-n:])
            if at >= 0:
                break
        else:
            return []
        follow = text[at + n:at + n + TEXT_DRAFT_CHARS]
        ids = tok.encode(last + follow, add_special_tokens=False)
        if len(ids) < 2 or ids[0] != tokens[-1]:
            return []
        return ids[1:k + 1]

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``tokens``: the longer of the n-gram and the suffix
        corpus matches, the sequence's own on equal lengths (n-gram alone for method "ngram").

        With a corpus the own match is measured as far as the tree's depth, not cut at
        ``prompt_lookup_max``: a job repeating its own paragraph matches it for dozens of
        tokens, and cut at 5 it lost to any deeper match of earlier jobs' shared phrasing,
        which then drafted their words. Measured (16 jobs after 4, one stream, suffix): edit
        531 -> 573 accepted tokens, open chat 536 -> 557."""
        c = self.config
        top = c.prompt_lookup_max if self.corpus is None else max(
            c.prompt_lookup_max, c.suffix_decoding_max_tree_depth)
        n, start = ngram_match(tokens, c.prompt_lookup_min, top)
        if self.corpus is not None:
            depth, draft = self.corpus.propose(tokens, k)
            if depth > n:
                return draft
        return extend(tokens, start, k) if n else []

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verified draft; the sequence's next draft grows after a full acceptance and
        shrinks to one past what was accepted otherwise."""
        self.counters.add(drafted, accepted)
        self.worth.verified(seq.draft_depths, self._constrained(seq.request),
                            min(seq.draft_forced, drafted), drafted, accepted)
        top = self.config.num_speculative_tokens
        seq.spec_len = min(top, drafted + 1) if accepted == drafted else max(1, accepted + 1)

    def finished(self, seq: Sequence) -> None:
        """A sequence ended: its prompt and output join the suffix corpus, and the governor
        counts the batch's turnover."""
        self.governor.sequence_finished()
        if self.corpus is not None and seq.finish_reason in ("stop", "length"):
            self.corpus.add(list(seq.token_ids))

    def stats(self) -> dict[str, Any]:
        out = {"spec_method": self.config.method, **self.counters.stats(),
               "spec_governor": self.governor.snapshot(),
               "spec_lookup_acceptance_by_depth": self.worth.snapshot()}
        if self.corpus is not None:
            out.update(self.corpus.stats())
        return out
