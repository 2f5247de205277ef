"""Constraints the structured-output tests share, each with an independent validity oracle
(jsonschema for schemas, re.fullmatch for regexes, membership for choices, a hand-written
recognizer for the grammar)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

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
# Sums of digits with one level of parentheses, in xgrammar's EBNF (GBNF dialect); bounded, so
# a random model ends it. GRAMMAR_RE is the same language, the oracle.
GRAMMAR = ('root ::= term ("+" term){0,3}\n'
           'term ::= [0-9] | "(" [0-9] ("+" [0-9]){0,2} ")"')
GRAMMAR_RE = r"(?:[0-9]|\([0-9](?:\+[0-9]){0,2}\))(?:\+(?:[0-9]|\([0-9](?:\+[0-9]){0,2}\))){0,3}"

CONSTRAINTS = {
    "json": {"json": PERSON},
    "json_small": {"json": SMALL},
    "json_object": {"json_object": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICE},
    "grammar": {"grammar": GRAMMAR},
}
# What a model that picks garbage still ends within a few dozen tokens.
BOUNDED = ("json_small", "regex", "choice", "grammar")


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
    assert spec == GRAMMAR, "is_valid knows GRAMMAR's language only"
    return re.fullmatch(GRAMMAR_RE, text) is not None


def build_random_model(path: Path, seed: int = 0) -> Path:
    """A tiny random-weight Llama that speaks the bundled model's tokenizer (49k tokens): it
    picks garbage, so only a constraint can make its output valid."""
    from pagedq.worker.models.loader import resolve_model
    from tests.tiny_models import build_tiny_model

    source = resolve_model(None)
    tokenizer = load_bundled_tokenizer()
    build_tiny_model("llama", path, seed, vocab_size=len(tokenizer),
                     eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def load_bundled_tokenizer():
    from pagedq.worker.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))
