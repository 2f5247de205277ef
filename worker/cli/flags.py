"""The flags only the terminal commands have: sampling (with the per-command defaults, one
table) and structured output. Flags for config dataclasses (the engine's, the queue's, the
worker's) and ``--log-level`` are the config layer's: pagedq.worker.config_flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pagedq.errors import InvalidParamsError
from pagedq.params import SamplingParams
from pagedq.worker.config_flags import add_config_flags, given

# -- sampling flags ---------------------------------------------------------------------------
# SamplingParams (the wire vocabulary, pagedq.params) carries no per-field docs; its flags'
# help is here.
SAMPLING_HELP = {
    "n": "Samples per prompt.",
    "temperature": "Randomness of sampling; 0 is greedy.",
    "top_p": "Sample from the smallest set of tokens whose probability reaches this mass.",
    "top_k": "Sample from the k most likely tokens (0: all).",
    "min_p": "Drop tokens less likely than this fraction of the most likely one.",
    "seed": "Makes sampling reproducible: the same seed, prompt and params give the same "
            "tokens on any worker.",
    "max_tokens": "Most tokens to generate per sample.",
    "min_tokens": "Tokens to generate before EOS or a stop token may end a sample.",
    "stop": "Stop when the text contains this string (repeatable); the string is cut off.",
    "stop_token_ids": "Stop at this token id (repeatable).",
    "ignore_eos": "Keep generating past the end-of-sequence token.",
    "presence_penalty": "Penalty for tokens already in the output (-2 to 2).",
    "frequency_penalty": "Penalty per occurrence of a token in the output (-2 to 2).",
    "repetition_penalty": "Divides the logits of tokens seen in the prompt or output (1: off).",
    "logprobs": "Return the log-probabilities of this many top tokens per position.",
    "skip_special_tokens": "Leave special tokens out of the output text.",
    "speculative": "Let the engine's speculative decoding (--speculative-config) draft tokens "
                   "for this request; the output is the same either way.",
}


# -- per-command sampling defaults: the one table -----------------------------------------------
# ``SamplingParams()`` keeps vLLM's defaults (temperature 1.0, max_tokens 16): what the SDK and
# the wire mean when a caller says nothing, so code ported from vLLM behaves the same. A person
# at a terminal wants a greedy, readable answer instead, so each command has its own row here
# (and only here); every command is greedy, and the lengths differ for the reason given.
# `pagedq serve` answers OpenAI's API with OpenAI's defaults (gateway/openai.py): chat
# max_tokens None (up to the model's length), completions 16, temperature 1.0.
COMMAND_SAMPLING: dict[str, dict[str, Any]] = {
    # the answer is the command's whole output, read once: room for a paragraph
    "generate": {"max_tokens": 128, "temperature": 0.0},
    "chat": {"max_tokens": 128, "temperature": 0.0},
    # a job put on a shared queue from a terminal, often to check a fleet answers: half as
    # long, so a busy worker's answer still comes back in seconds
    "submit": {"max_tokens": 64, "temperature": 0.0},
    # several answers stream side by side in one live view on a CPU: short enough that each
    # fits its rows and all finish within seconds
    "demo": {"max_tokens": 48, "temperature": 0.0},
}


def add_sampling_flags(parser: argparse.ArgumentParser, *, defaults: dict[str, Any],
                       skip: Iterable[str] = ()) -> None:
    """SamplingParams fields as flags in a "sampling" group; ``defaults`` are the command's own
    (a terminal user wants greedy and longer outputs than the wire's defaults)."""
    group = parser.add_argument_group("sampling")
    add_config_flags(group, SamplingParams, defaults=SamplingParams(**defaults),
                     skip=skip, helps=SAMPLING_HELP)
    add_structured_flags(parser)


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any]) -> Any:
    """SamplingParams from the command's defaults and the sampling flags given."""
    structured = structured_outputs(args)
    extra = {"structured_outputs": structured} if structured else {}
    return SamplingParams(**{**defaults, **given(args, SamplingParams), **extra})


# -- structured output flags ------------------------------------------------------------------
def add_structured_flags(parser: argparse.ArgumentParser) -> None:
    """One of --json-schema, --json-object, --regex, --choice, --grammar (docs/structured.md)."""
    group = parser.add_argument_group(
        "structured output", "constrain the output; at most one of these (docs/structured.md)")
    one = group.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", default=argparse.SUPPRESS,
                     help="the output is JSON valid under the JSON Schema in FILE")
    one.add_argument("--json-object", action="store_true", default=argparse.SUPPRESS,
                     help="the output is a JSON object")
    one.add_argument("--regex", metavar="R", default=argparse.SUPPRESS,
                     help="the output matches the regular expression R as a whole")
    one.add_argument("--choice", metavar="A,B,C", default=argparse.SUPPRESS,
                     help="the output is exactly one of these comma-separated strings")
    one.add_argument("--grammar", metavar="FILE", default=argparse.SUPPRESS,
                     help="the output follows the EBNF grammar in FILE (GBNF: root ::= ...)")


def structured_outputs(args: argparse.Namespace) -> dict[str, Any] | None:
    """The structured_outputs dict the structured-output flags ask for (None: none given)."""
    def read(flag: str, path: str) -> str:
        try:
            return Path(path).expanduser().read_text()
        except OSError as exc:
            raise InvalidParamsError(f"{flag} {path}: {exc.strerror or exc}") from exc

    if hasattr(args, "json_schema"):
        return {"json": read("--json-schema", args.json_schema)}
    if getattr(args, "json_object", False):
        return {"json_object": True}
    if hasattr(args, "regex"):
        return {"regex": args.regex}
    if hasattr(args, "choice"):
        return {"choice": [c for c in args.choice.split(",") if c]}
    if hasattr(args, "grammar"):
        return {"grammar": read("--grammar", args.grammar)}
    return None
