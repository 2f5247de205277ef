"""Flags derived from config dataclasses: one flag per field, named after it, helped by its doc.

A field ``max_num_seqs: int = 64`` with a docstring below it becomes ``--max-num-seqs N``, whose
help is that docstring; a bool becomes ``--name/--no-name`` (argparse.BooleanOptionalAction);
a ``Literal`` becomes a choice. Flags default to "not given" (argparse.SUPPRESS), so the
dataclass stays the only place a default lives: ``given(args, cls)`` returns just what the
user typed, and the command builds its config from that. ``to_flags`` goes the other way, for
commands that start a worker subprocess with a config in hand.

This is the config layer's (beside pagedq.worker.config), not the CLI's: the worker's commands
(pagedq.worker.cli), the gateway's ``serve``/``batch`` (which start an embedded worker with the
engine flags given) and the bench all import it downward, and none imports another's CLI. The
flags only a terminal command has (sampling, structured output) are pagedq.worker.cli.flags.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pagedq.worker.config import EngineConfig, parse_bytes

# Old spellings still accepted, hidden from --help: field -> flags
ENGINE_ALIASES: dict[str, tuple[str, ...]] = {"num_threads": ("--threads",),
                                               "enable_prefix_caching": ("--no-prefix-caching",)}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's help: the class's ``FLAG_HELP[name]`` (a subclass rewording an inherited
    field for its command, e.g. QueueConfig's redis_url), else ``metadata["help"]``, else the
    string literal right below the field (an attribute docstring), inherited from base
    dataclasses too; whitespace collapsed."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, doc in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                docs[node.target.id] = " ".join(doc.value.value.split())
    for f in dataclasses.fields(cls):
        if f.metadata.get("help"):
            docs[f.name] = f.metadata["help"]
    docs.update(getattr(cls, "FLAG_HELP", {}))  # a config's wording for its command
    return docs


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _argument(kind: Any) -> dict[str, Any] | None:
    """argparse keywords for a field's type; None for types no flag can carry (dicts...)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Annotated:  # Annotated[int, parser]: the flag's type
        return {"type": flag_type(args[1])}
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return _argument(rest[0]) if len(rest) == 1 else None
    if typing.get_origin(kind) is typing.Literal:
        return {"choices": list(args), "type": type(args[0])}
    if typing.get_origin(kind) is list and args and args[0] in (int, float, str):
        return {"action": "append", "type": args[0]}
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if kind in (int, float, str, Path):
        return {"type": kind}
    return None


def add_config_flags(parser: argparse.ArgumentParser | Any, cls: type, *,
                     defaults: Any = None, only: Iterable[str] | None = None,
                     skip: Iterable[str] = (), helps: dict[str, str] | None = None,
                     aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    """Add one flag per field of dataclass ``cls`` to ``parser`` (or an argument group).

    ``defaults``: an instance whose values --help shows (default: the class's own defaults;
    the command must build its config from the same instance). ``only``/``skip`` pick fields,
    ``helps`` replaces a field's help for this command, ``aliases`` adds hidden spellings.
    """
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = field_docs(type(defaults) if isinstance(defaults, cls) else cls)  # a subclass's own
    wanted = set(only) if only is not None else None
    for f in dataclasses.fields(cls):
        if f.name in skip or (wanted is not None and f.name not in wanted):
            continue
        kw = _argument(hints[f.name])
        if kw is None:
            continue
        shown = getattr(defaults, f.name) if defaults is not None else field_default(f)
        text = (helps or {}).get(f.name) or docs.get(f.name, "")
        if shown not in (None, []) and "default:" not in text:
            text += f" (default: {_show(shown)})"
        parser.add_argument(flag_name(f.name), dest=f.name, default=argparse.SUPPRESS,
                            help=text.strip().replace("%", "%%") or None,
                            metavar=_metavar(f.name, kw), **kw)
        for alias in (aliases or {}).get(f.name, ()):
            if kw.get("action") is argparse.BooleanOptionalAction:
                parser.add_argument(alias, dest=f.name, action="store_false",
                                    default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            else:
                parser.add_argument(alias, dest=f.name, type=kw.get("type"),
                                    default=argparse.SUPPRESS, help=argparse.SUPPRESS)


@functools.cache
def flag_type(parse: Any) -> Any:
    """``parse`` as an argparse type: its ValueError's message becomes the usage error."""
    @functools.wraps(parse)
    def parse_flag(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse_flag


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _metavar(name: str, kw: dict[str, Any]) -> str | None:
    if "choices" in kw or kw.get("action") is argparse.BooleanOptionalAction:
        return None
    if getattr(kw.get("type"), "__wrapped__", None) is parse_bytes:
        return "SIZE"
    return {int: "N", float: "X"}.get(kw.get("type"), name.upper())


def given(args: argparse.Namespace, cls: type, *, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The fields of ``cls`` the user set on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and hasattr(args, f.name)}


def to_flags(config: Any) -> list[str]:
    """Command-line flags that rebuild ``config`` (only fields that differ from the default)."""
    out: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None or value == field_default(f):
            continue
        if isinstance(value, bool):
            out.append(flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:])
        elif isinstance(value, (int, float, str, Path)):
            out += [flag_name(f.name), str(value)]
        elif hasattr(value, "to_json"):  # a nested config given as JSON (speculative_config)
            out += [flag_name(f.name), value.to_json()]
    return out


# -- the engine's flags -----------------------------------------------------------------------
def add_engine_flags(parser: argparse.ArgumentParser, *, defaults: EngineConfig | None = None,
                     helps: dict[str, str] | None = None) -> None:
    """Every EngineConfig field as a flag, in an "engine" group."""
    group = parser.add_argument_group("engine")
    add_config_flags(group, EngineConfig, defaults=defaults, helps=helps, aliases=ENGINE_ALIASES)


def engine_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields given on the command line (``Engine(**engine_knobs(args))``)."""
    return given(args, EngineConfig)


# -- the one --log-level ----------------------------------------------------------------------
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_log_level_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                       default: str = "INFO") -> None:
    """``--log-level``, the one definition every command uses (worker, serve, chat, plan, ...)."""
    parser.add_argument("--log-level", default=default, choices=LOG_LEVELS, type=str.upper,
                        help="least severe log lines shown on stderr; INFO shows what each long "
                        f"wait is doing (default: {default})")
