"""Compile each structured-output constraint once per tokenizer, off the engine thread.

A constraint (a JSON Schema, any JSON object, a regex, a choice or an EBNF grammar) becomes an
xgrammar ``CompiledGrammar``: the grammar plus a per-state cache of allowed tokens, so that a
mask during decoding costs microseconds. Compiling costs tens to hundreds of milliseconds, so
it runs in a small thread pool (xgrammar releases the GIL) and its result is kept in an LRU
keyed by (kind, canonical text): 64 requests with one schema compile it once. The engine polls
a ``GrammarTicket`` each step and never blocks on it.

A compile can not be interrupted; one that runs past ``timeout_s`` fails every request waiting
on it, and that verdict is cached like any other error so the same constraint fails fast next
time. xgrammar itself is imported and its tokenizer table built on the first constrained
request, in the pool, so an engine that never sees one never pays for either.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pagedq.errors import EngineError, InvalidParamsError
from pagedq.params import StructuredOutputsParams
from pagedq.worker.engine.number_bounds import bound_numbers
from pagedq.worker.engine.schema_check import check_schema

# xgrammar's character class for a JSON string with minLength/maxLength admits raw control
# characters (invalid JSON) where the JSON grammar's own class excludes them; the generated
# grammar is corrected before it compiles. Escapes stay out of length-bounded strings: an
# escape would count as several characters of the bound.
_LAX_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


@dataclass(eq=False)
class _Entry:
    future: Future
    started: float | None = None  # when a pool thread began compiling
    error: InvalidParamsError | None = None  # a verdict reached without the future (timeout)


@dataclass(eq=False)
class GrammarTicket:
    """A request's claim on a compile; ``GrammarCache.poll`` answers it."""

    kind: str
    entry: _Entry = field(repr=False)


class GrammarCache:
    """An LRU of compiled constraints for one tokenizer, filled by a small thread pool."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int] | list[int],
                 *, max_entries: int = 128, num_threads: int = 2, timeout_s: float = 10.0) -> None:
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="pagedq-grammar")
        self._compiler = self._pool.submit(_Compiler, tokenizer, vocab_size, sorted(stop_token_ids))
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> GrammarTicket:
        """Start (or join) the compile of ``params``; returns at once."""
        key = (params.kind, params.spec)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = _Entry(Future())
                entry.future = self._pool.submit(self._compile, entry, *key)
                self._entries[key] = entry
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            self._entries.move_to_end(key)
        return GrammarTicket(params.kind, entry)

    def poll(self, ticket: GrammarTicket) -> Any | None:
        """The compiled grammar, or None while it compiles; raises InvalidParamsError when the
        constraint is invalid, unsupported, or took longer than ``timeout_s`` to compile
        (EngineError when this worker can not compile grammars at all)."""
        entry = ticket.entry
        if entry.error is not None:
            raise entry.error
        if entry.future.done():
            return entry.future.result()  # raises the compile's InvalidParamsError
        if entry.started is not None and time.monotonic() - entry.started > self.timeout_s:
            entry.error = InvalidParamsError(
                f"structured_outputs.{ticket.kind}: compiling took longer than {self.timeout_s:g} s; "
                "simplify it (fewer alternatives, smaller repetition counts)")
            raise entry.error
        return None

    def wait(self, ticket: GrammarTicket) -> Any:
        """Block until the ticket resolves (tests and offline tools; never the engine step)."""
        while True:
            compiled = self.poll(ticket)
            if compiled is not None:
                return compiled
            time.sleep(0.002)

    @property
    def bitmask_backend(self) -> Any:
        """The xgrammar module, once loaded (the engine thread's matchers come from it)."""
        return self._compiler.result().xgr

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, entry: _Entry, kind: str, spec: str) -> Any:
        try:
            compiler = self._compiler.result()
        except Exception as exc:  # xgrammar missing, or a tokenizer it can not read
            raise EngineError(f"structured outputs are unavailable on this worker: {exc!r}") from exc
        entry.started = time.monotonic()
        return compiler.compile(kind, spec)


class _Compiler:
    """xgrammar's compiler for one tokenizer; each method turns one constraint kind into a grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # The LRU above is the cache; xgrammar's own would hold every grammar twice.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: str) -> Any:
        try:
            if kind == "json":
                check_schema(json.loads(spec))
                return self._json(spec, strict=True)
            if kind == "json_object":
                return self._json('{"type": "object"}', strict=False)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "tools":
                return self._tools(json.loads(spec))
            return self.compiler.compile_grammar(spec)
        except InvalidParamsError:
            raise
        except Exception as exc:  # xgrammar reports every bad input as RuntimeError/ValueError
            raise InvalidParamsError(f"structured_outputs.{kind}: {_reason(exc)}") from exc

    def _json(self, schema: str, strict: bool) -> Any:
        """JSON as ``json.dumps`` writes it: ", " and ": ", no other whitespace (a model free
        to add whitespace can spend its whole budget on it). ``strict`` closes objects that
        do not say ``additionalProperties``, as OpenAI's strict mode does."""
        grammar = self.xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
        return self.compiler.compile_grammar(json_ebnf(grammar))


    def _tools(self, spec: dict[str, Any]) -> Any:
        """Text and/or calls in the family's format (pagedq.tools), each call's arguments held
        to its function's schema by the same strict, number-bounded JSON grammar as ``json``."""
        from pagedq.tools import ToolSpec, get_format

        tools = ToolSpec.coerce(spec)
        contents = {}
        for name, schema in tools.functions:
            check_schema(schema)
            grammar = self.xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=False, strict_mode=True)
            contents[name] = {"type": "grammar", "grammar": json_ebnf(grammar)}
        tag = get_format(tools.format).structural_tag(tools, contents)
        return self.compiler.compile_grammar(self.xgr.Grammar.from_structural_tag(json.dumps(tag)))


def json_ebnf(grammar: Any) -> str:
    """The text of an xgrammar JSON grammar, made strict: control characters out of strings,
    every free number's digits bounded (number_bounds: a ``number`` always ends)."""
    return bound_numbers(str(grammar).replace(_LAX_STRING_CHAR, _JSON_STRING_CHAR))


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix ("[time] file.cc:123: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition(": ")
        if ".cc:" in head or ".h:" in head:
            text = rest
    return text
