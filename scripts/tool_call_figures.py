"""Valid tool calls out of N under sampling (the figures in docs/gateway.md).

    python scripts/tool_call_figures.py [--model PATH|random|bundled] [--seeds 16]

For each tool_choice mode, N seeded chats at temperature 1.0 through the engine's ``tools``
constraint (the SDK route; the gateway adds only the response shape). A call counts as valid
when its arguments parse and validate against its function's schema (jsonschema).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jsonschema

from pagedq.params import SamplingParams
from pagedq.tools import HERMES, parse_tool_calls
from pagedq.worker import Engine
from tests.engine.structured_cases import build_random_model
from tests.gateway.test_tools import ADD, ORDER, SCHEMAS, WEATHER

QUESTIONS = ["What is the weather in Paris in celsius?", "What is 12.5 plus 7?",
             "Order two units of ABC for Ann, gold tier, express.",
             "Weather in Tokyo for 3 days, fahrenheit please."]
MODES = {"required": "required", "named": "place_order", "auto": "auto"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    if args.model == "random":
        engine = Engine(str(build_random_model(Path(tempfile.mkdtemp()))), num_kv_blocks=2048)
    else:
        engine = Engine(None if args.model == "bundled" else args.model, num_kv_blocks=2048,
                        max_num_batched_tokens=512)
    tools = [WEATHER, ADD, ORDER]
    for mode, choice in MODES.items():
        convs = [[{"role": "user", "content": QUESTIONS[s % len(QUESTIONS)]}]
                 for s in range(args.seeds)]
        plist = [SamplingParams(temperature=1.0, seed=s, max_tokens=args.max_tokens,
                                structured_outputs={"tools": {"tools": tools,
                                                              "tool_choice": choice}})
                 for s in range(args.seeds)]
        began = time.perf_counter()
        outs = engine.chat(convs, plist)
        calls = valid = stopped = 0
        for out in outs:
            o = out.outputs[0]
            stopped += o.finish_reason == "stop"
            for call in parse_tool_calls(o.text, HERMES)[1]:
                calls += 1
                try:
                    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
        print(json.dumps({"model": args.model, "mode": mode, "requests": args.seeds,
                          "ended_stop": stopped, "finished_calls": calls, "valid_calls": valid,
                          "seconds": round(time.perf_counter() - began, 1)}), flush=True)


if __name__ == "__main__":
    main()
