"""Compile each structured-output constraint once per tokenizer, off the engine thread.

A constraint (a JSON Schema, any JSON object, a regex, a choice or an EBNF grammar) becomes an
xgrammar ``CompiledGrammar``: the grammar plus a per-state cache of allowed tokens, so that a
mask during decoding costs microseconds. Compiling costs tens of milliseconds to, for a hostile
schema, minutes, so it runs in child processes (grammar_child.py, one per pool thread) and its
result, sent back serialized, is kept in an LRU keyed by (kind, canonical text): 64 requests
with one schema compile it once. The engine polls a ``GrammarTicket`` each step and never
blocks on it.

A compile has ``timeout_s`` from its submission, waiting in the pool included: past it, every
request waiting on it fails, its child is killed (so the next compile does not queue behind
it), and the verdict is cached like any other error so the same constraint fails fast next
time. xgrammar itself is imported, its tokenizer table built and the children started on the
first constrained request, in the pool, so an engine that never sees one never pays for them.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pagedq.errors import EngineError, InvalidParamsError
from pagedq.logging import get_logger
from pagedq.params import StructuredOutputsParams
from pagedq.tools import ToolSpec, get_format
from pagedq.worker.engine import grammar_child
from pagedq.worker.engine.schema_check import check_schema

log = get_logger("pagedq.engine.grammar")


CHILD_START_S = 60.0  # a compile process's start: import xgrammar, read the tokenizer table


class CompileTimeout(Exception):
    """A compile ran past its deadline (its child was killed)."""


@dataclass(eq=False)
class _Entry:
    future: Future
    submitted: float = field(default_factory=time.monotonic)  # the time limit runs from here
    paused: float = 0.0  # seconds not counted: a compile process starting (inf while it does)
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
        self._compiler = self._pool.submit(_Compiler, tokenizer, vocab_size, sorted(stop_token_ids),
                                           num_threads)
        self._ready_at: float | None = None  # when the compiler and its processes were ready
        self._compiler.add_done_callback(lambda _: setattr(self, "_ready_at", time.monotonic()))
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
        if self._ready_at is None:  # the compiler is being built: no compile has begun
            return None
        if time.monotonic() - self._start(entry) - entry.paused > self.timeout_s:
            entry.error = self._too_slow(ticket.kind)
            raise entry.error
        return None

    def _start(self, entry: _Entry) -> float:
        """When the entry's time limit began: its submission, or once the compiler was ready."""
        return max(entry.submitted, self._ready_at or time.monotonic())

    def _too_slow(self, kind: str) -> InvalidParamsError:
        return InvalidParamsError(
            f"structured_outputs.{kind}: compiling took longer than {self.timeout_s:g} s; "
            "simplify it (fewer alternatives, patterns and properties, smaller repetition "
            "counts)")

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
        if self._compiler.done() and self._compiler.exception() is None:
            self._compiler.result().close()

    def _compile(self, entry: _Entry, kind: str, spec: str) -> Any:
        try:
            compiler = self._compiler.result()
        except Exception as exc:  # xgrammar missing, or a tokenizer it can not read
            raise EngineError(f"structured outputs are unavailable on this worker: {exc!r}") from exc
        try:
            return compiler.compile(kind, spec, entry, self._start(entry) + self.timeout_s)
        except CompileTimeout:
            raise self._too_slow(kind) from None

    @property
    def children(self) -> tuple[int, int]:
        """(compile processes started, killed at a deadline): stats and tests."""
        if not self._compiler.done() or self._compiler.exception() is not None:
            return 0, 0
        compiler = self._compiler.result()
        return len(compiler.children), compiler.killed


@contextmanager
def paused(entry: _Entry) -> Iterator[None]:
    """The time spent inside does not count against the entry's limit (poll sees inf)."""
    began, before = time.monotonic(), entry.paused
    entry.paused = float("inf")
    try:
        yield
    finally:
        entry.paused = before + time.monotonic() - began


class _Compiler:
    """One tokenizer's compiles: each pool thread sends its constraints to a child process of
    its own and deserializes what comes back against the tokenizer table built here."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 processes: int = 1) -> None:
        # measured: xgrammar takes ~2.5 s to import after torch; only the first structured request pays it
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._info_line = json.dumps({"tokenizer_info": self.info.serialize_json()}) + "\n"
        self._local = threading.local()  # each pool thread's child
        self._spares = [self._spawn() for _ in range(processes)]  # started at once, together
        self._spares = [self._ready(child) for child in self._spares]
        self.children: list[subprocess.Popen] = list(self._spares)
        self._lock = threading.Lock()
        self.killed = 0

    def compile(self, kind: str, spec: str, entry: _Entry, deadline: float) -> Any:
        """``kind``/``spec`` compiled by this thread's child before ``deadline`` (monotonic;
        a process start meanwhile does not count); CompileTimeout (the child killed) past it."""
        if kind == "json":
            check_schema(json.loads(spec))
            job = {"op": "json", "spec": spec, "strict": True}
        elif kind == "json_object":
            job = {"op": "json", "spec": '{"type": "object"}', "strict": False}
        elif kind == "choice":
            job = {"op": "grammar", "spec": choice_grammar(json.loads(spec))}
        elif kind == "tools":
            job = {"op": "structural_tag", "spec": self._tools_tag(json.loads(spec))}
        else:
            job = {"op": "regex" if kind == "regex" else "grammar", "spec": spec}
        if time.monotonic() >= deadline:  # its time ran out in the pool
            raise CompileTimeout()
        reply = self._ask(job, entry, deadline)
        if "error" in reply:
            raise InvalidParamsError(f"structured_outputs.{kind}: {_reason(reply['error'])}")
        return self.xgr.CompiledGrammar.deserialize_json(reply["ok"], self.info)

    def _tools_tag(self, spec: dict[str, Any]) -> str:
        """The structural tag of a tool set (pagedq.tools): text and/or calls in the family's
        format, each call's arguments held to its function's schema by the same strict,
        number-bounded JSON grammar as ``json`` (the child compiles it)."""
        tools = ToolSpec.coerce(spec)
        contents = {}
        for name, schema in tools.functions:
            check_schema(schema)
            grammar = self.xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=False, strict_mode=True)
            contents[name] = {"type": "grammar", "grammar": json_ebnf(grammar)}
        return json.dumps(get_format(tools.format).structural_tag(tools, contents))

    def _ask(self, job: dict[str, Any], entry: _Entry, deadline: float) -> dict[str, Any]:
        before = entry.paused
        with paused(entry):  # starting a process is ours, not the compile's
            child = self._child()
        deadline += entry.paused - before
        try:
            child.stdin.write(json.dumps(job) + "\n")
            child.stdin.flush()
            ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = child.stdout.readline() if ready else ""
        except OSError:
            line = ""
        if line:
            return json.loads(line)
        timed_out = child.poll() is None
        self._kill(child)
        if timed_out:
            raise CompileTimeout()
        raise EngineError("the grammar compiler process died (out of memory?); the next "
                          "constrained request starts a new one")

    def _child(self) -> subprocess.Popen:
        """This pool thread's process: its own, a spare started with the compiler, or new."""
        child = getattr(self._local, "child", None)
        if child is None or child.poll() is not None:
            with self._lock:
                child = self._spares.pop() if self._spares else None
            if child is None or child.poll() is not None:
                child = self._ready(self._spawn())
                with self._lock:
                    self.children.append(child)
            self._local.child = child
        return child

    def _spawn(self) -> subprocess.Popen:
        child = subprocess.Popen(
            [sys.executable, grammar_child.__file__], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1 << 16)
        child.stdin.write(self._info_line)
        child.stdin.flush()
        return child

    def _ready(self, child: subprocess.Popen) -> subprocess.Popen:
        """Wait for a new process's "ready" line (it has imported xgrammar, read the table)."""
        ready, _, _ = select.select([child.stdout], [], [], CHILD_START_S)
        if not ready or not child.stdout.readline():
            child.kill()
            child.wait()
            raise EngineError("the grammar compiler process did not start; structured "
                              "outputs are unavailable on this worker")
        return child

    def _kill(self, child: subprocess.Popen) -> None:
        child.kill()
        child.wait()
        self._local.child = None
        self.killed += 1
        log.warning("grammar compile stopped: its process was killed", pid=child.pid)

    def close(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
                child.wait()


def json_ebnf(grammar: Any) -> str:
    """The text of an xgrammar JSON grammar, made strict (grammar_child.json_ebnf: no control
    characters in strings, every free number's digits bounded)."""
    return grammar_child.json_ebnf(str(grammar))


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


def _reason(message: str) -> str:
    """xgrammar's message without its C++ source location prefix ("[time] file.cc:123: ")."""
    text = message.strip().splitlines()[0] if message.strip() else "invalid"
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition(": ")
        if ".cc:" in head or ".h:" in head:
            text = rest
    return text
