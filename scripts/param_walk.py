"""The walk of ``quantization`` from ``Engine.__init__``: which rooms (files) the choice and
what it becomes (the ``packed=`` flag, the weight form, the weights in that form, the packed
projections) pass through while an engine is built, in order.

    python scripts/param_walk.py [--model M] [--quantization auto]

Builds one Engine under ``sys.setprofile`` and keeps each product function of the walk the
first time it runs (a function that runs once per weight counts once: the walk is the code's
shape, not the checkpoint's size). Consecutive functions in one file are one stay; a stay in a
file an earlier stay already visited is a return. The functions of the walk: the model layer
(worker/models/), the kernels' selector, block formats and ops (kernels/backend.py,
block_formats.py, cpu_ops.py) and Engine.__init__, less the reads that do not depend on the
quantization (config, tokenizer, RoPE tables, logging).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's pagedq, not an installed one
ROOMS = ("worker/models/", "kernels/backend.py", "kernels/block_formats.py", "kernels/cpu_ops.py",
         "worker/engine/engine.py")
NOT_THE_WALK = ("load_config", "load_tokenizer", "rope_tables", "rope_frequencies", "<genexpr>",
                "<listcomp>", "<dictcomp>", "<lambda>", "__post_init__", "hf_name", "_rows",
                "unpermute_rows", "num_kv_heads", "head_dim", "weight_format",
                "release_freed_heap")  # malloc_trim after any load: no quantization in it


def _room(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    return rel if rel.startswith(ROOMS) else None


def trace(model: str | None, quantization: str) -> list[tuple[str, str]]:
    """(room, function) of each walk function, first calls in order."""
    from pagedq.worker import Engine

    seen: set[tuple[str, str]] = set()
    order: list[tuple[str, str]] = []

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event != "call":
            return
        code = frame.f_code
        room = _room(code.co_filename)
        name = code.co_qualname
        if room is None or name.split(".")[-1] in NOT_THE_WALK:
            return
        if room == "worker/engine/engine.py" and name != "Engine.__init__":
            return
        if (room, name) not in seen:
            seen.add((room, name))
            order.append((room, name))

    sys.setprofile(profile)
    try:
        Engine(model, quantization=quantization, max_model_len=256, kv_cache_memory="32MiB")
    finally:
        sys.setprofile(None)
    return order


def stays(order: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for room, name in order:
        if out and out[-1][0] == room:
            out[-1][1].append(name)
        else:
            out.append((room, [name]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--quantization", default="auto")
    args = parser.parse_args(argv)
    walk = stays(trace(args.model, args.quantization))
    visited: set[str] = set()
    returns = 0
    lines = []
    for i, (room, names) in enumerate(walk, 1):
        again = room in visited
        returns += again
        visited.add(room)
        lines.append(f"| {i} | {room} | {', '.join(names)} | {'return' if again else ''} |")
    sys.stdout.write("| stay | room | functions | |\n|---|---|---|---|\n" + "\n".join(lines)
                     + f"\n\n{len(walk)} stays, {len(visited)} rooms, {returns} returns\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
