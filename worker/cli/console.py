"""What the commands read from and say to a person at a terminal: prompts from arguments,
files or stdin, logs as readable lines with live progress, and events as sentences."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from pagedq.errors import InvalidRequestError

PROMPT_HELP = "the prompt: text, @FILE to read it from a file, or - for standard input"


def setup_console_logging(level: str = "INFO") -> None:
    """Readable log lines on stderr, and a live timer under each long wait on a terminal."""
    # measured: structlog (under both) adds ~0.2 s to `pagedq --help` (0.9 s), which never logs
    from pagedq.logging import configure_logging
    from pagedq.progress import enable_live

    configure_logging(json=False, level=level)
    enable_live()


def read_prompt(arg: str, stdin: TextIO | None = None) -> str:
    """The prompt an argument names: ``-`` is standard input, ``@path`` a file's text, ``@@x``
    the literal text ``@x``, anything else itself. Raises InvalidRequestError when it cannot
    be read or is empty, so a bad prompt fails before a model loads."""
    if arg == "-":
        text = (stdin or sys.stdin).read()
        where = "standard input"
    elif arg.startswith("@@"):
        text, where = arg[1:], "the argument"
    elif arg.startswith("@") and len(arg) > 1:
        path = Path(arg[1:]).expanduser()
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise InvalidRequestError(f"cannot read the prompt file {path}: {reason}") from None
        where = str(path)
    else:
        text, where = arg, "the argument"
    if not text.strip():
        raise InvalidRequestError(f"the prompt from {where} is empty: give some text")
    return text


def read_prompts(args: list[str], stdin: TextIO | None = None) -> list[str]:
    if args.count("-") > 1:
        raise InvalidRequestError("standard input (-) can be read only once")
    return [read_prompt(a, stdin) for a in args]


FINISH_REASONS = {
    "stop": "the model ended its answer",
    "length": "it reached the token limit (--max-tokens)",
    "deadline": "its deadline passed",
    "abort": "it was aborted",
}


def finish_sentence(reasons: list[str | None] | None, usage: dict[str, int] | None) -> str:
    """``finished`` as a person reads it: why it ended and what it cost."""
    why = sorted({FINISH_REASONS.get(r or "", r or "unknown") for r in (reasons or [None])})
    used = usage or {}
    return (f"done: {'; '.join(why)} ({used.get('completion_tokens', 0)} tokens generated, "
            f"prompt {used.get('prompt_tokens', 0)} tokens)")


def event_sentence(ev: Any) -> str:
    """A terminal event (finished, error, cancelled) as one sentence."""
    if ev.type == "finished":
        return finish_sentence(ev.finish_reasons, ev.usage)
    if ev.type == "error":
        return f"failed ({ev.error_code}): {ev.error}"
    return f"{ev.type}"
