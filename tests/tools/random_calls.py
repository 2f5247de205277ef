"""What every tool-call format's test asks of a random-weight model: over several seeds and tool
choices (required, a named function, one call only), every call that ends with "stop" parses in
that format, names a declared function and validates against its schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from pagedq.tools import ToolFormat, parse_tool_calls
from tests.engine.structured_cases import build_random_model
from tests.engine.test_tool_calls import ASK, tools_params
from tests.gateway.test_tools import ORDER, SCHEMAS


def random_engine(folder: Path):
    """A random model with the bundled tokenizer, small blocks (many block boundaries)."""
    from pagedq.worker import Engine

    return Engine(str(build_random_model(folder)), num_kv_blocks=1024, block_size=4)


def assert_calls_validate(engine, fmt_name: str, fmt: ToolFormat, closes: str = "") -> None:
    """Ten sampled chats under ``fmt_name`` (a Mistral syntax); at least five end, and each that
    ends is only calls (from ``[TOOL_CALLS]`` to ``closes``, when given) that validate."""
    plist = [tools_params("required", seed=s, fmt=fmt_name) for s in range(4)]
    plist += [tools_params("add", seed=s, fmt=fmt_name) for s in range(3)]
    plist += [tools_params("required", seed=s, fmt=fmt_name, tools=[ORDER],
                           spec={"parallel_tool_calls": False}) for s in range(3)]
    ended = 0
    for out, p in zip(engine.chat([ASK] * len(plist), plist), plist, strict=True):
        o = out.outputs[0]
        if o.finish_reason != "stop":
            continue
        ended += 1
        assert o.text.startswith("[TOOL_CALLS]") and o.text.rstrip().endswith(closes)
        content, calls = parse_tool_calls(o.text, fmt)
        assert calls and not content.strip()
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        spec = p.structured_outputs.tool_spec
        if spec.forced or not spec.parallel_tool_calls:
            assert len(calls) == 1
    assert ended >= 5
