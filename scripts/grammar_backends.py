"""Measure the two structured-output backends, xgrammar and llguidance, on a local tokenizer.

For each backend: tokenizer set-up time, compile time of each constraint kind (a nested JSON
schema, any JSON object, a regex, a choice, an EBNF/Lark grammar), the per-token mask fill time
(p50/p99) along random walks that pick uniformly among the allowed tokens (the worst case for
a mask: every state a sampler could reach, not just the likely ones), whether each walk's text
is valid (jsonschema / re.fullmatch / membership), whether rollback and replay restore a
matcher's state, and the mask fill of a full batch (64 matchers on the nested schema, each fed
a different valid document). The figures back docs/structured.md's choice of backend.

    pip install llguidance   # xgrammar is a dependency; llguidance only for this comparison
    python3 scripts/grammar_backends.py [--tokenizer DIR ...] [--walks 20] [--json PATH]

Nothing downloads: each --tokenizer is a local directory with tokenizer.json (default: the
bundled SmolLM2 model's).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from pathlib import Path

import jsonschema
import torch

DEFAULT_TOKENIZER = Path.home() / ".cache/pagedq/models/SmolLM2-135M-Instruct"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                            {"type": "null"}]},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{1,2})?"
CHOICE = ["positive", "negative", "neutral"]
# The same tiny arithmetic grammar in each library's syntax.
EBNF_XGRAMMAR = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]{1,3} | "(" expr ")"'
LARK_LLGUIDANCE = 'start: expr\nexpr: term ("+" term)*\nterm: /[0-9]{1,3}/ | "(" expr ")"'
EXPR_RE = r"[0-9()+]+"
# JSON as json.dumps writes it (", " and ": "), no free whitespace: both backends the same.
JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check(kind: str, text: str) -> bool:
    """Whether a finished walk's text satisfies its constraint (an independent oracle)."""
    try:
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "json_object":
            return isinstance(json.loads(text), dict)
        elif kind == "regex":
            return re.fullmatch(REGEX, text) is not None
        elif kind == "choice":
            return text in CHOICE
        else:
            return re.fullmatch(EXPR_RE, text) is not None and _balanced(text)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tok, vocab: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        started = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - started
        self.vocab = vocab

    def compile(self, kind: str):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        if kind == "json_object":  # the builtin JSON grammar admits any value, arrays too
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(REGEX)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in CHOICE))
        return c.compile_grammar(EBNF_XGRAMMAR)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=200)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, m, mask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(mask, row)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tok, vocab: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        started = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos[0])
        self.setup_s = time.perf_counter() - started
        self.vocab = vocab

    def compile(self, kind: str):
        M = self.llg.LLMatcher
        if kind == "json":
            grammar = M.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTS)
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema({"type": "object"},
                                                 defaults=JSON_OPTS)
        elif kind == "regex":
            grammar = M.grammar_from_regex(REGEX)
        elif kind == "choice":
            grammar = self.llg.grammar_from("choice", json.dumps(CHOICE))
        else:
            grammar = M.grammar_from_lark(LARK_LLGUIDANCE)
        # The matcher builds its lexer eagerly: its construction is the compile.
        m = M(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(rows, self.vocab)

    def fill(self, m, mask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(m, mask, row)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


def allowed_tokens(mask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (mask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


def walk(backend, compiled, rng: random.Random, max_tokens: int) -> tuple[list[int], list[float], bool]:
    """One random walk: returns its tokens, the fill time per token, and whether it ended."""
    m = backend.matcher(compiled)
    mask = backend.bitmask(1)
    tokens: list[int] = []
    times: list[float] = []
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        backend.fill(m, mask, 0)
        times.append(time.perf_counter() - t0)
        allowed = allowed_tokens(mask[0], backend.vocab)
        token = int(allowed[rng.randrange(len(allowed))])
        if not backend.accept(m, token):
            raise AssertionError(f"{backend.name} rejected a token its own mask allowed")
        tokens.append(token)
        if backend.done(m):
            return tokens, times, True
    return tokens, times, False


def rollback_replay_ok(backend, compiled, tokens: list[int]) -> tuple[bool, bool]:
    """Rollback: undo the last half and the next mask equals the mask at that point.
    Replay: a fresh matcher fed the same prefix gives the same mask."""
    if len(tokens) < 4:
        return True, True
    half = len(tokens) // 2
    ref, mask = backend.matcher(compiled), backend.bitmask(2)
    for t in tokens[:half]:
        backend.accept(ref, t)
    backend.fill(ref, mask, 0)
    m = backend.matcher(compiled)
    for t in tokens[:-1]:
        backend.accept(m, t)
    backend.rollback(m, len(tokens) - 1 - half)
    backend.fill(m, mask, 1)
    rollback = torch.equal(mask[0], mask[1])
    fresh = backend.matcher(compiled)
    for t in tokens[:half]:
        backend.accept(fresh, t)
    backend.fill(fresh, mask, 1)
    return rollback, torch.equal(mask[0], mask[1])


def measure(backend, tok, walks: int, max_tokens: int) -> dict:
    out: dict = {"setup_s": round(backend.setup_s, 3), "kinds": {}}
    for kind in ("json", "json_object", "regex", "choice", "grammar"):
        t0 = time.perf_counter()
        try:
            compiled = backend.compile(kind)
        except Exception as exc:  # noqa: BLE001 - a measurement records every failure
            out["kinds"][kind] = {"error": str(exc)[:200]}
            continue
        compile_s = time.perf_counter() - t0
        rng = random.Random(0)
        fill: list[float] = []
        valid = ended = 0
        rb_ok = replay_ok = True
        for _ in range(walks):
            tokens, times, done = walk(backend, compiled, rng, max_tokens)
            fill += times
            ended += done
            body = [t for t in tokens if t not in EOS]
            valid += done and check(kind, tok.decode(body))
            rb, rp = rollback_replay_ok(backend, compiled, body)
            rb_ok &= rb
            replay_ok &= rp
        fill.sort()
        out["kinds"][kind] = {
            "compile_ms": round(compile_s * 1e3, 1),
            "fill_us_p50": round(statistics.median(fill) * 1e6, 1),
            "fill_us_p99": round(fill[int(0.99 * (len(fill) - 1))] * 1e6, 1),
            "tokens": len(fill), "walks_ended": ended, "walks_valid": valid,
            "rollback_ok": rb_ok, "replay_ok": replay_ok,
        }
    return out


def batch_fill(backend, tok, rows: int = 64) -> dict:
    """A full batch the way the engine sees it: ``rows`` matchers of the nested schema, each
    fed a different valid document token by token, one batch mask fill per step."""
    rng = random.Random(0)
    docs = [json.dumps(_person(rng), ensure_ascii=False) for _ in range(rows)]
    compiled = backend.compile("json")
    t0 = time.perf_counter()
    matchers = [backend.matcher(compiled) for _ in docs]
    per_matcher = (time.perf_counter() - t0) / rows
    tokens = [tok(d).input_ids + [tok.eos_token_id] for d in docs]
    mask = backend.bitmask(rows)
    full: list[float] = []
    for step in range(max(map(len, tokens))):
        live = [i for i in range(rows) if step < len(tokens[i])]
        t0 = time.perf_counter()
        for i in live:
            backend.fill(matchers[i], mask, i)
        if len(live) == rows:
            full.append(time.perf_counter() - t0)
        for i in live:
            if not backend.accept(matchers[i], tokens[i][step]):
                raise AssertionError(f"{backend.name} rejected a valid document: {docs[i]}")
    full.sort()
    return {"rows": rows, "matcher_ms": round(per_matcher * 1e3, 3),
            "step_ms_p50": round(statistics.median(full) * 1e3, 2),
            "step_ms_p99": round(full[int(0.99 * (len(full) - 1))] * 1e3, 2),
            "row_us_p50": round(statistics.median(full) / rows * 1e6, 1), "steps": len(full)}


def _person(rng: random.Random) -> dict:
    words = ["alice", "bob", "Paris", "data", "x", "New York", "engineer", "blue", "Zürich"]
    return {"name": rng.choice(words), "age": rng.randrange(0, 121),
            "email": rng.choice([None, "bob@mail.com"]), "role": rng.choice(["admin", "user"]),
            "tags": [rng.choice(words)[:8] for _ in range(rng.randint(1, 3))],
            "address": {"city": rng.choice(words), "zip": f"{rng.randrange(100000):05d}"}}


EOS: set[int] = set()


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", action="append", default=None)
    ap.add_argument("--walks", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for path in args.tokenizer or [str(DEFAULT_TOKENIZER)]:
        tok = AutoTokenizer.from_pretrained(path)
        vocab = len(tok)
        EOS.clear()
        EOS.add(tok.eos_token_id)
        per = {}
        for cls in (XGrammarBackend, LLGuidanceBackend):
            backend = cls(tok, vocab, [tok.eos_token_id])
            per[backend.name] = measure(backend, tok, args.walks, args.max_tokens)
            per[backend.name]["batch"] = batch_fill(backend, tok)
            print(json.dumps({"tokenizer": path, "vocab": vocab, backend.name: per[backend.name]},
                             indent=1))
        results[f"{Path(path).name} ({vocab})"] = per
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
