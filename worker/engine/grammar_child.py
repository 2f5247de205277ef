"""The grammar-compile child: one process that compiles constraints with xgrammar, so that a
compile past its time limit can be stopped for real (killed) rather than left running on a
thread. ``grammar_cache.py`` starts it as a script (``python grammar_child.py``), so the child
imports xgrammar and the standard library only, never torch or the engine.

The protocol is one JSON object per line. In: first ``{"tokenizer_info": "..."}`` (xgrammar's
``TokenizerInfo.serialize_json()``), then ``{"op": "json"|"regex"|"grammar"|"structural_tag",
"spec": "...",
"strict": bool}`` per compile. Out: ``{"ready": true}`` once the compiler is built, then
``{"ok": "..."}`` (``CompiledGrammar.serialize_json()``) or ``{"error": "..."}``, one line per
compile.
"""

from __future__ import annotations

import json
import sys

try:  # run as a script (grammar_cache starts it so): its own folder is on sys.path
    from number_bounds import bound_numbers
except ImportError:  # imported as a module (the parent uses json_ebnf and __file__)
    from pagedq.worker.engine.number_bounds import bound_numbers

# xgrammar's character class for a JSON string with minLength/maxLength admits raw control
# characters (invalid JSON) where the JSON grammar's own class excludes them; the generated
# grammar is corrected before it compiles. Escapes stay out of length-bounded strings: an
# escape would count as several characters of the bound.
LAX_STRING_CHAR = r'[^\"\\\r\n]'
JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def json_ebnf(text: str) -> str:
    """The text of an xgrammar JSON grammar, made strict: control characters out of strings,
    every free number's digits bounded (number_bounds: a ``number`` always ends)."""
    return bound_numbers(text.replace(LAX_STRING_CHAR, JSON_STRING_CHAR))


def compile_one(xgr, compiler, op: str, spec: str, strict: bool):
    """One constraint -> a CompiledGrammar. JSON as ``json.dumps`` writes it: ", " and ": ",
    no other whitespace (a model free to add whitespace can spend its whole budget on it);
    ``strict`` closes objects that do not say ``additionalProperties`` (OpenAI's strict)."""
    if op == "json":
        grammar = xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=strict)
        return compiler.compile_grammar(json_ebnf(str(grammar)))
    if op == "structural_tag":  # tool calls (grammar_cache builds the tag)
        return compiler.compile_grammar(xgr.Grammar.from_structural_tag(spec))
    if op == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_grammar(spec)


def main() -> None:
    # xgrammar (~2.5 s) in the child only: the parent imports this module for its path
    import xgrammar as xgr

    first = json.loads(sys.stdin.readline())
    info = xgr.TokenizerInfo.deserialize_json(first["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        job = json.loads(line)
        try:
            compiled = compile_one(xgr, compiler, job["op"], job["spec"], job.get("strict", True))
            reply = {"ok": compiled.serialize_json()}
        except Exception as exc:  # xgrammar reports every bad input as RuntimeError/ValueError
            reply = {"error": str(exc) or type(exc).__name__}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
