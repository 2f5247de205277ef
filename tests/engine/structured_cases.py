"""Constraints the structured-output tests share, each with an independent validity oracle
(jsonschema for schemas, re.fullmatch for regexes, membership for choices, a hand-written
recognizer for the grammar)."""

from __future__ import annotations

import json
import re

import jsonschema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"},
                            {"type": "null"}]},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
}
# Bounded everywhere, so even a model that picks tokens at random finishes it quickly.
SMALL = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -5, "maximum": 5},
        "label": {"enum": ["red", "green", "blue"]},
        "code": {"anyOf": [{"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}, {"type": "null"}]},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
               "minItems": 1, "maxItems": 2},
    },
    "required": ["ok", "n", "label", "code", "xs"],
}
REGEX = r"(yes|no), [0-9]{1,3}( (kg|g))?"
CHOICE = ["positive", "negative", "neutral"]
# Sums of small numbers with parentheses, in xgrammar's EBNF (GBNF dialect).
GRAMMAR = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'

CONSTRAINTS = {
    "json": {"json": PERSON},
    "json_small": {"json": SMALL},
    "json_object": {"json_object": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICE},
    "grammar": {"grammar": GRAMMAR},
}


def is_valid(constraint: dict, text: str) -> bool:
    """Whether ``text`` satisfies ``constraint`` (a structured_outputs dict)."""
    (kind, spec), = constraint.items()
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), json.loads(spec) if isinstance(spec, str) else spec)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    return is_sum_expression(text)


def is_sum_expression(text: str) -> bool:
    """The recognizer of GRAMMAR: term ("+" term)* with term = digit | "(" expr ")"."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] == "+":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos].isdigit() and text[pos].isascii():
            pos += 1
            return True
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        return False

    return expr() and pos == len(text)
