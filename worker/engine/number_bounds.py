"""Bound the digits of JSON numbers in a compiled grammar, so that a ``number`` ends.

xgrammar writes an unbounded JSON number as ``[1-9] [0-9]*`` with a fraction and an exponent
of ``{1, -1}`` digits. A model that likes a digit (SmolLM2 writes ``1.1111111...``) can then
spend its whole ``max_tokens`` inside one number, and the JSON never parses. Here the grammar's
text is rewritten before it compiles:

- a free ``number``: at most ``SIGNIFICANT`` digits in its mantissa (integer and fraction
  together), at most ``EXPONENT`` exponent digits;
- a free ``integer``, or the open side of a half-bounded one (``minimum`` only): at most
  ``SIGNIFICANT`` digits.

A schema that bounds its number itself (``minimum`` and ``maximum``) says otherwise: xgrammar
already spells such a range out digit by digit, and it is left as it is. The rewrite matches
xgrammar's own rule shapes (its tests pin them: ``tests/engine/test_number_bounds.py``); a
string ``pattern`` is a different shape and is never touched.
"""

from __future__ import annotations

import re

SIGNIFICANT = 15  # what an IEEE double holds exactly
EXPONENT = 3  # 1e308 is the largest double

# basic_number ::= ((SIGN MANTISSA FRACTION EXPONENT)), with any rule-name prefix
_NUMBER_RULE = re.compile(
    r"^(?P<name>\w*basic_number) ::= \(\((?P<sign>\w+) (?P<int>\w+) (?P<frac>\w+) (?P<exp>\w+)\)\)$",
    re.M)
# "0" or a nonzero digit and any more digits: a JSON integer's digits
_FREE_DIGITS = re.compile(r'(\("0"\) \| \((?:\w+ )?\[1-9\]) \[0-9\]\*\)')
# [1-9] DIGIT{1, -1}: the open side of a half-bounded range (its DIGIT rule is ([0-9]))
_OPEN_RANGE = re.compile(r"\[1-9\] (\w+)\{1, -1\}")
# [eE] SIGN DIGIT{1, -1}: an exponent
_EXPONENT = re.compile(r"(\[eE\] \w+ \w+)\{1, -1\}")


def bound_numbers(ebnf: str, significant: int = SIGNIFICANT, exponent: int = EXPONENT) -> str:
    """``ebnf`` (xgrammar's text of a JSON grammar) with every free number's digits bounded."""
    ebnf = _EXPONENT.sub(rf"\1{{1, {exponent}}}", ebnf)
    ebnf = _FREE_DIGITS.sub(rf"\1 [0-9]{{0, {significant - 1}}})", ebnf)
    ebnf = _OPEN_RANGE.sub(rf"[1-9] \1{{1, {significant - 1}}}", ebnf)
    for m in list(_NUMBER_RULE.finditer(ebnf)):
        ebnf = _rule(ebnf, m["int"], mantissa(significant))
        ebnf = _rule(ebnf, m["frac"], '("")')
    return ebnf


def mantissa(significant: int) -> str:
    """A JSON number's digits and fraction with at most ``significant`` digits in all (leading
    zeros of ``0.000x`` count too: every alternative is a fixed, finite length)."""
    alts = [f'("0" ("" | ("." [0-9]{{1, {significant}}})))']
    for k in range(1, significant + 1):
        head = "[1-9]" + (f" [0-9]{{{k - 1}, {k - 1}}}" if k > 1 else "")
        alts.append(f"({head})" if k == significant
                    else f'({head} ("" | ("." [0-9]{{1, {significant - k}}})))')
    return "(" + " | ".join(alts) + ")"


def _rule(ebnf: str, name: str, body: str) -> str:
    """``ebnf`` with rule ``name``'s body replaced by ``body``."""
    pattern = re.compile(rf"^{re.escape(name)} ::= .*$", re.M)
    return pattern.sub(lambda _: f"{name} ::= {body}", ebnf, count=1)
