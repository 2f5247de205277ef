"""``pagedq generate`` and ``pagedq chat``: run the engine in this process, from the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagedq.errors import EngineError, InvalidParamsError
from pagedq.worker.cli.flags import add_engine_flags, add_sampling_flags, engine_knobs, sampling_params

# A terminal user wants a greedy, readable answer, not the wire's 16 random tokens.
SAMPLING_DEFAULTS: dict[str, Any] = {"max_tokens": 128, "temperature": 0.0}
# --seed is the engine's field; given, it also seeds each request (see sampling_from_args).
SEED_HELP = ("Seed of the random draws: the same seed, prompt and flags give the same output "
             "(default: 0)")


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate from prompts in this process",
                         description="Load the model and generate from each prompt; a single "
                         "prompt streams its text as it is produced.")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.set_defaults(func=run, chat=False)
    chat = sub.add_parser("chat", help="like generate, with the model's chat template applied",
                          description="Send each message as its own conversation through the "
                          "model's chat template; a single message streams its reply.")
    chat.add_argument("prompts", nargs="+", help="user message(s), one conversation each")
    chat.add_argument("--system", default=None, help="a system message for every conversation")
    chat.set_defaults(func=run, chat=True)
    for p in (gen, chat):
        p.add_argument("--json", action="store_true", help="print results as JSON lines")
        add_engine_flags(p, helps={"seed": SEED_HELP})
        add_sampling_flags(p, defaults=SAMPLING_DEFAULTS, skip=("seed", "logprobs"))


def sampling_from_args(args: argparse.Namespace) -> Any:
    """The sampling flags; ``--seed`` also becomes each request's seed, so a seeded run's
    output does not depend on how its prompts were batched."""
    params = sampling_params(args, SAMPLING_DEFAULTS)
    if getattr(args, "seed", None) is not None:
        params.seed = args.seed
        params.validate()
    return params


def run(args: argparse.Namespace) -> int:
    from pagedq.worker import Engine
    from pagedq.worker.logging import configure_logging

    configure_logging(level="WARNING")
    try:
        params = sampling_from_args(args)
        engine = Engine(**engine_knobs(args))
        prompts = [engine.apply_chat_template(conversation(args, p)) if args.chat else p
                   for p in args.prompts]
        if len(prompts) == 1 and params.n == 1 and not args.json:
            return stream_one(engine, prompts[0], params)
        for out in engine.generate(prompts, params):
            for c in out.outputs:
                if args.json:
                    print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text,
                                      "token_ids": c.token_ids,
                                      "finish_reason": c.finish_reason}))
                else:
                    print(f"--- [{out.request_id} #{c.index}] ({c.finish_reason})\n{c.text}")
    except (EngineError, InvalidParamsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


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
    sys.stdout.write("\n")
    return 0
