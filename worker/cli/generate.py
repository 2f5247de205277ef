"""``pagedq generate`` and ``pagedq chat``: run the engine in this process, from the terminal.

Everything a person can get wrong (an empty prompt, a bad flag, a prompt too long for the
model) is checked before the weights load, and the KV cache is sized for these prompts, not
for a server's load.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from pagedq.errors import InvalidParamsError, InvalidRequestError, PagedQError
from pagedq.params import StructuredOutputsParams
from pagedq.tools import get_format, parse_tool_calls
from pagedq.tools.prompt import check_template_kwargs
from pagedq.worker.cli.console import PROMPT_HELP, read_prompts, setup_console_logging
from pagedq.worker.cli.flags import COMMAND_SAMPLING, add_sampling_flags, sampling_params
from pagedq.worker.config import EngineConfig
from pagedq.worker.config_flags import add_engine_flags, add_log_level_flag, engine_knobs

# --seed is the engine's field; given, it also seeds each request (see sampling_from_args).
SEED_HELP = ("Seed of the random draws: the same seed, prompt and flags give the same output "
             "(default: 0)")


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="continue a text in this process (plain completion)",
                         description="Load the model and continue each prompt as plain text "
                         "(no chat template; `pagedq chat` applies it). One prompt streams its "
                         "text as it is produced.")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help=PROMPT_HELP + " (several: "
                     "one completion each)")
    gen.set_defaults(func=run, chat=False)
    chat = sub.add_parser("chat", help="ask the model a question in this process",
                          description="Load the model and answer each message as its own "
                          "conversation, through the model's chat template. One message "
                          "streams its reply.")
    chat.add_argument("prompts", nargs="+", metavar="MESSAGE",
                      help=PROMPT_HELP + " (several: one conversation each)")
    chat.add_argument("--system", default=None, help="a system message for every conversation")
    chat.add_argument("--tools", default=None, metavar="FILE",
                      help="a JSON file of OpenAI function tools (a list, or {\"tools\": [...]}): "
                      "the reply may call them, every call valid against its schema")
    chat.add_argument("--tool-choice", default="auto", metavar="CHOICE",
                      help="with --tools: auto (text or calls), required, or a function's name")
    chat.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                      help="extra chat template variables, a JSON object (vLLM's field), e.g. "
                      "'{\"enable_thinking\": false}' for Qwen3")
    chat.set_defaults(func=run, chat=True)
    for command, p in (("generate", gen), ("chat", chat)):
        p.add_argument("--json", action="store_true", help="print results as JSON lines")
        add_log_level_flag(p)
        add_engine_flags(p, helps={"seed": SEED_HELP})
        add_sampling_flags(p, defaults=COMMAND_SAMPLING[command], skip=("seed", "logprobs"))


def sampling_from_args(args: argparse.Namespace) -> Any:
    """The sampling flags; ``--seed`` also becomes each request's seed, so a seeded run's
    output does not depend on how its prompts were batched."""
    params = sampling_params(args, COMMAND_SAMPLING["chat" if args.chat else "generate"])
    if getattr(args, "seed", None) is not None:
        params.seed = args.seed
        params.validate()
    if getattr(args, "tools", None):
        if params.structured_outputs is not None:
            raise InvalidParamsError("--tools takes no other constraint flag")
        params.structured_outputs = StructuredOutputsParams(tools=read_tools(args))
    return params


def read_tools(args: argparse.Namespace) -> dict[str, Any]:
    """``--tools FILE`` and ``--tool-choice`` as the ``tools`` constraint (pagedq.tools)."""
    try:
        with open(args.tools, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidParamsError(f"--tools {args.tools}: {exc}") from exc
    tools = data.get("tools") if isinstance(data, dict) else data
    return {"tools": tools, "tool_choice": args.tool_choice}


def run(args: argparse.Namespace) -> int:
    from pagedq.logging import get_logger  # structlog: ~0.2 s on `pagedq --help`
    from pagedq.progress import waiting  # the same

    setup_console_logging(args.log_level)
    log = get_logger("pagedq.cli")
    try:
        texts = read_prompts(args.prompts)
        params = sampling_from_args(args)
        config = EngineConfig(**engine_knobs(args))
        with waiting("reading the model's tokenizer and checking the prompts", log):
            prompts, config, files = prepare(config, texts, params, args)
        from pagedq.worker import Engine  # torch (seconds): `pagedq --help` never loads it

        with waiting("loading the model", log, delay=0, model=config.model):
            engine = Engine(config=config, files=files)
        if len(prompts) == 1 and params.n == 1 and not args.json:
            return stream_one(engine, prompts[0], params)
        for text, out in zip(texts, engine.generate(prompts, params), strict=True):
            for c in out.outputs:
                if args.json:
                    print(json.dumps({"prompt": text, "index": c.index, "text": c.text,
                                      "token_ids": c.token_ids,
                                      "finish_reason": c.finish_reason, **calls(params, c.text)}))
                else:
                    print(f"--- {text[:60]!r}, sample {c.index + 1}: {c.finish_reason}\n{c.text}")
    except PagedQError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def prepare(config: Any, texts: list[str], params: Any, args: argparse.Namespace
            ) -> tuple[list[list[int]], Any, Any]:
    """Token ids of each prompt (chat template applied for ``chat``), checked against the
    model's length, ``config`` with the KV cache the engine says they need (unless a size was
    asked for), and the model's opened files, which the engine then loads without resolving or
    reading the tokenizer again. Reads the model's config and tokenizer only, never its
    weights."""
    # torch and transformers (seconds): `pagedq --help`, submit and stats never load them
    from pagedq.worker.engine.intake import chat_prompt, tokenize
    from pagedq.worker.engine.sizing import fit_cache
    from pagedq.worker.models.build import open_model

    kwargs = check_template_kwargs(template_kwargs(getattr(args, "chat_template_kwargs", None)))
    files = open_model(config)  # the engine's rule: the bundled GGUF stays packed
    if args.chat:
        prompts = [chat_prompt(files.tokenizer, files.path, conversation(args, t), params,
                               kwargs) for t in texts]
    else:
        prompts = [tokenize(files.tokenizer, files.hf_config.vocab_size, files.path, t, None)[1]
                   for t in texts]
    config = fit_cache(replace(config, model=str(files.path)), files.hf_config, prompts, params)
    return prompts, config, files


def template_kwargs(text: str | None) -> dict[str, Any] | None:
    """``--chat-template-kwargs``: a JSON object (chat_prompt checks its names and size)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"--chat-template-kwargs must be a JSON object, e.g. "
                                  f"'{{\"enable_thinking\": false}}': {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError("--chat-template-kwargs must be a JSON object, e.g. "
                                  "'{\"enable_thinking\": false}'")
    return value


def calls(params: Any, text: str) -> dict[str, Any]:
    """``{"tool_calls": [...]}`` parsed from ``text`` when ``params`` declare tools."""
    so = params.structured_outputs
    if so is None or so.kind != "tools":
        return {}
    _, found = parse_tool_calls(text, get_format(so.tool_spec.format))
    return {"tool_calls": [c.to_openai() for c in found]}


def conversation(args: argparse.Namespace, message: str) -> list[dict]:
    msgs = [{"role": "system", "content": args.system}] if args.system else []
    return msgs + [{"role": "user", "content": message}]


def stream_one(engine: Any, prompt: str | list[int], params: Any) -> int:
    """Print text as the engine produces it."""
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
        for _, exc in engine.take_rejected():  # e.g. a constraint that did not compile
            raise exc
    sys.stdout.write("\n")
    return 0
