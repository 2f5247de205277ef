"""Sampling parameters: the vocabulary the SDK, the wire protocol and the engine share.

Field names follow vLLM's ``SamplingParams`` so that code written for vLLM ports unchanged.
This module imports nothing heavy: the client SDK must never pull in torch.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pagedq.errors import InvalidParamsError
from pagedq.tools import ToolSpec

# Bounds no request may cross whatever a worker allows: every integer fits the engine's 32-bit
# tensors, and no list can make validation itself slow. A worker's own limits
# (pagedq.client.protocol.Limits) are usually far lower.
INT_BOUND = 2**31
MAX_N = 1024
MAX_STOP = 1024
MAX_STOP_CHARS = 4096
MAX_LOGPROBS = 20
MAX_CONSTRAINT_CHARS = 64 << 10  # a schema's canonical JSON, a regex, a grammar, the choices
MAX_SCHEMA_PATTERNS = 64  # "pattern" strings in one schema: each is a regex to compile
MAX_SCHEMA_DEPTH = 128  # nested objects/arrays of a JSON Schema: far past real ones, far below
# the interpreter's recursion limit (copying, encoding and compiling a schema all recurse)
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, 100 all but forces it

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tools")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON Schema, any JSON object, a regex, a choice or a grammar.

    Exactly one field is set (vLLM's names). ``json`` is a JSON Schema as a dict or a JSON
    string; ``grammar`` is an EBNF grammar in the GBNF dialect (``root ::= ...``, llama.cpp's
    and xgrammar's). ``tools`` is a ``pagedq.tools.ToolSpec`` or its dict (tools, tool_choice,
    parallel_tool_calls, format): the output is text and/or calls in the model family's
    format, every call valid against its function's schema. Only the syntax is checked here;
    whether a schema, regex or grammar compiles is the engine's to say (the SDK has no grammar
    library), and it answers with ``InvalidParamsError`` naming the problem.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    tools: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        if self.tools is not None and not isinstance(self.tools, dict):
            if isinstance(self.tools, ToolSpec):
                self.tools = self.tools.to_dict()
        self.validate()

    @property
    def kind(self) -> str:
        """The one constraint set: "json", "json_object", "regex", "choice" or "grammar"."""
        return self._set_kinds()[0]

    def _set_kinds(self) -> list[str]:
        return [k for k in STRUCTURED_KINDS
                if getattr(self, k) is not None and not (k == "json_object" and not self.json_object)]

    def validate(self) -> None:
        """Raise InvalidParamsError naming the first problem."""
        def bad(why: str) -> InvalidParamsError:
            return InvalidParamsError(f"SamplingParams.structured_outputs: {why}")

        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad(f"json_object={self.json_object!r} must be true")
        set_kinds = self._set_kinds()
        if len(set_kinds) != 1:
            raise bad(f"set exactly one of {list(STRUCTURED_KINDS)}, got "
                      f"{set_kinds or 'none'}")
        if self.json is not None:
            self._schema()  # parses a string schema, checks it is an object
        size = sum(len(c) for c in self.choice if isinstance(c, str)) \
            if isinstance(self.choice, list) else 0
        for value in (self.json, self.regex, self.grammar):
            if isinstance(value, str):
                size += len(value)
        if self.json is not None and not isinstance(self.json, str):
            size += len(jsonlib.dumps(self.json, separators=(",", ":")))
        if size > MAX_CONSTRAINT_CHARS:
            raise bad(f"the constraint is {size} characters; at most {MAX_CONSTRAINT_CHARS} "
                      "(compiling it could take minutes): simplify it")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise bad(f"choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise bad(f"choice must hold non-empty strings, got {self.choice!r}")
        if self.tools is not None:
            self.tool_spec  # noqa: B018 (validates)

    @property
    def tool_spec(self):
        """The ``tools`` constraint as a validated ``pagedq.tools.ToolSpec``."""
        return ToolSpec.coerce(self.tools)

    def _schema(self) -> dict[str, Any]:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = jsonlib.loads(schema)
            except (ValueError, RecursionError) as exc:
                raise InvalidParamsError(
                    f"SamplingParams.structured_outputs.json is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise InvalidParamsError("SamplingParams.structured_outputs.json must be a JSON Schema "
                                     f"object (a dict or its JSON text), got {type(schema).__name__}")
        if json_depth(schema) > MAX_SCHEMA_DEPTH:
            raise InvalidParamsError(
                "SamplingParams.structured_outputs.json nests objects and arrays more than "
                f"{MAX_SCHEMA_DEPTH} levels deep: flatten the schema (use $defs and $ref)")
        patterns = count_patterns(schema)
        if patterns > MAX_SCHEMA_PATTERNS:
            raise InvalidParamsError(
                f"SamplingParams.structured_outputs.json has {patterns} \"pattern\" regexes; at "
                f"most {MAX_SCHEMA_PATTERNS} (each compiles into the grammar): merge or drop some")
        return schema

    @property
    def spec(self) -> str:
        """The constraint as canonical text: the compile cache's key together with ``kind``.

        A schema given as a dict and as its JSON text (any spacing) shares one entry. Key order
        is kept: properties are generated in the schema's order."""
        kind = self.kind
        if kind == "json":
            return jsonlib.dumps(self._schema(), separators=(",", ":"))
        if kind == "json_object":
            return ""
        if kind == "choice":
            return jsonlib.dumps(self.choice)
        if kind == "tools":
            return jsonlib.dumps(self.tool_spec.to_dict(), separators=(",", ":"))
        return getattr(self, kind)

    def to_dict(self) -> dict[str, Any]:
        """The one set field, for the wire (msgpack)."""
        return {self.kind: getattr(self, self.kind)}

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        """Accept the dataclass, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidParamsError(
                "SamplingParams.structured_outputs must be a dict with one of "
                f"{list(STRUCTURED_KINDS)} or a StructuredOutputsParams, got {type(value).__name__}")
        unknown = sorted(str(k) for k in value if k not in STRUCTURED_KINDS)
        if unknown:
            raise InvalidParamsError(
                f"unknown structured_outputs keys {unknown}; use exactly one of {list(STRUCTURED_KINDS)}")
        return cls(**value)


def json_depth(value: Any, stop: int = MAX_SCHEMA_DEPTH + 1) -> int:
    """How deeply dicts and lists nest in ``value`` (0 for a scalar), counted without recursion
    and up to ``stop`` only, so a hostile 10,000-level document costs nothing."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if not isinstance(item, (dict, list, tuple)):
            continue
        deepest = max(deepest, depth)
        if depth >= stop:
            return deepest
        children = item.values() if isinstance(item, dict) else item
        todo.extend((child, depth + 1) for child in children)
    return deepest


def count_patterns(schema: Any) -> int:
    """How many ``pattern`` regexes a JSON Schema holds, anywhere in it (iteratively)."""
    count, todo = 0, [schema]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            count += isinstance(item.get("pattern"), str)
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return count


@dataclass
class SamplingParams:
    """How to sample one request's output.

    temperature 0 means greedy. ``seed`` makes sampling reproducible: a seeded request's random
    draw at each position is a function of (seed, sample index, position) only, so a job resumed
    on another worker continues exactly. The logits the draw reads come from a batched forward
    pass, whose float32 rounding can differ in the last bits with the batch's shape (its batch
    mates); about one token in 50,000 flips where two candidates are that close, in greedy and
    seeded requests alike. A resumed job replays its published tokens, so its stream stays one
    consistent sequence either way.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # vLLM's: each prompt token's logprob given the tokens before it (the first is None), plus
    # this many top alternatives; such a request reads nothing from the prefix cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before sampling
    logit_bias: dict[int, float] | None = None
    # False: never speculate for this request (the engine's speculative_config decides
    # otherwise); the output is the same either way, only its speed differs
    speculative: bool = True

    def __post_init__(self) -> None:
        if self.logit_bias is not None:
            self.logit_bias = _token_keys(self.logit_bias)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise InvalidParamsError naming the first bad field."""

        def bad(name: str, why: str) -> InvalidParamsError:
            return InvalidParamsError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not is_num(getattr(self, name)):
                raise bad(name, "must be a finite number")
        if not 0.0 <= self.temperature < float("inf"):
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or not 0 <= self.top_k < INT_BOUND:
            raise bad("top_k", f"must be an integer in [1, {INT_BOUND}), or 0/-1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be an integer in [0, 2**63) or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens)
                                            or not 1 <= self.max_tokens < INT_BOUND):
            raise bad("max_tokens", f"must be an integer in [1, {INT_BOUND}) or None (up to "
                      "the model's length)")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens < INT_BOUND:
            raise bad("min_tokens", f"must be an integer in [0, {INT_BOUND})")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                                 for s in self.stop):
            raise bad("stop", f"must be at most {MAX_STOP} non-empty strings of at most "
                      f"{MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP or not all(
                is_int(t) and 0 <= t < INT_BOUND for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be at most {MAX_STOP} token ids in "
                      f"[0, {INT_BOUND})")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "must be a bool")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", "must be a bool")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        if self.logprobs is not None and (not is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None and (
                not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] (top "
                      "alternatives per prompt token) or None")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for token, value in bias.items():
                if not is_int(token) or not 0 <= token < INT_BOUND:
                    raise bad("logit_bias", f"key {token!r} must be a token id (an integer >= 0)")
                if not is_num(value) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                    raise bad("logit_bias", f"bias {value!r} of token {token} must be a number "
                              f"in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the wire (msgpack); round-trips through ``from_dict``."""
        out = asdict(self)
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.to_dict()
        if self.logit_bias is not None:  # msgpack maps take string keys
            out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        if self.speculative:  # the default stays off the wire: older workers know no such key
            del out["speculative"]
        if self.prompt_logprobs is None:  # likewise
            del out["prompt_logprobs"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a wire dict; unknown keys are an error so typos never pass silently."""
        if not isinstance(data, dict):
            raise InvalidParamsError(f"sampling params must be a map, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise InvalidParamsError(
                f"unknown sampling params {unknown}; valid fields are {sorted(known)}"
            )
        try:
            return cls(**data)
        except TypeError as exc:  # wrong types that __post_init__ could not coerce
            raise InvalidParamsError(str(exc)) from exc


def _token_keys(bias: Any) -> Any:
    """logit_bias with its keys as ints (JSON and the wire send them as strings); anything
    else is left for ``validate`` to name."""
    if not isinstance(bias, dict):
        return bias
    out: dict[Any, Any] = {}
    for k, v in bias.items():
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        out[k] = v
    return out
