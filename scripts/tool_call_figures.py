"""Tool-call figures for docs/gateway.md: valid calls out of N, and throughput.

    python scripts/tool_call_figures.py [--model PATH|random|bundled] [--seeds 16]
    python scripts/tool_call_figures.py --throughput [--model bundled] [--seeds 64] [--pairs 2]
    python scripts/tool_call_figures.py --ttft [--model bundled] [--pairs 5]

Valid calls: for each tool_choice mode, N seeded chats at temperature 1.0 through the engine's
``tools`` constraint (the SDK route; the gateway adds only the response shape). A call counts
as valid when its arguments parse and validate against its function's schema (jsonschema).

Throughput: N chats at once with ``tool_choice: "required"`` against the same N chats without
tools, each plain row held to exactly the tokens its tool-call row wrote (``ignore_eos``,
``max_tokens`` = that count), so both runs do the same decode steps at the same batch sizes.
Two plain baselines: "chat" (the question alone, the issue's "plain chat") and "same prompt"
(the prompt with the tools listed, unconstrained: the grammar's own cost). Modes alternate
after the run that measures the lengths (grammar compiled, the tool prompts' prefixes cached);
output tokens per second of wall time, and the engine's own grammar-mask seconds. (This
process's CPU time was tried as a steadier measure on a shared machine: it was not, since
torch's threads spin while they wait for a core.)

Each throughput pair also runs the tools chats with the tool prompts *not* cached (the prefix
cache reset first: what a new tool set meets), with the scheduler's shared-prefix holds on and
off (``Scheduler.share_inflight_prefixes``), reporting the prompt tokens each computed.

TTFT (``--ttft``): one tools chat alone, its time to the first token with a tool set never seen
(new tools: new prompt prefix and grammar), with the same tools again (prefix and grammar
cached), with the prefix cache reset (grammar cached, prompt computed in full), and the plain
chat's (cached too after the first pair); alternated, medians printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jsonschema

# the tools and the random model are the tests' own (tests/): run from a checkout, as documented
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedq.params import SamplingParams  # noqa: E402
from pagedq.tools import HERMES, parse_tool_calls  # noqa: E402
from pagedq.worker import Engine  # noqa: E402
from tests.engine.structured_cases import build_random_model  # noqa: E402
from tests.gateway.test_tools import ADD, ORDER, SCHEMAS, WEATHER  # noqa: E402

QUESTIONS = ["What is the weather in Paris in celsius?", "What is 12.5 plus 7?",
             "Order two units of ABC for Ann, gold tier, express.",
             "Weather in Tokyo for 3 days, fahrenheit please."]
MODES = {"required": "required", "named": "place_order", "auto": "auto"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--throughput", action="store_true", help="tools vs plain chat instead")
    ap.add_argument("--pairs", type=int, default=2, help="alternations (--throughput, --ttft)")
    ap.add_argument("--ttft", action="store_true", help="time to first token with tools")
    args = ap.parse_args()
    if args.model == "random":
        engine = Engine(str(build_random_model(Path(tempfile.mkdtemp()))), num_kv_blocks=4096)
    else:
        engine = Engine(None if args.model == "bundled" else args.model, num_kv_blocks=4096,
                        max_num_batched_tokens=2048 if args.throughput else 512)
    if args.throughput:
        throughput(engine, args.seeds, args.pairs, min(args.max_tokens, 64))
    elif args.ttft:
        ttft(engine, args.pairs)
    else:
        valid_calls(engine, args)


def throughput(engine: Engine, n: int, pairs: int, max_tokens: int) -> None:
    spec = {"tools": [WEATHER, ADD, ORDER], "tool_choice": "required"}
    asks = [[{"role": "user", "content": QUESTIONS[s % len(QUESTIONS)]}] for s in range(n)]
    tool_params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens,
                                  structured_outputs={"tools": spec}) for s in range(n)]
    tool_prompts = [engine.apply_chat_template(a, p) for a, p in zip(asks, tool_params,
                                                                      strict=True)]
    chat_prompts = [engine.apply_chat_template(a) for a in asks]
    lengths = [len(o.outputs[0].token_ids) for o in engine.generate(tool_prompts, tool_params)]
    plain = [SamplingParams(temperature=1.0, seed=s, max_tokens=k, ignore_eos=True)
             for s, k in enumerate(lengths)]
    runs = {"tools": (tool_prompts, tool_params), "same prompt": (tool_prompts, plain),
            "chat": (chat_prompts, plain)}
    runs["new tools, holds on"] = runs["new tools, holds off"] = runs["tools"]
    tokens = sum(lengths)  # seeded: every tools run writes these again
    for pair in range(pairs):
        rate, computed, mask = {}, {}, 0.0
        order = list(runs)
        if pair % 2:  # alternate which of the two new-tools runs goes first
            order[-2:] = order[:-3:-1]
        for mode in order:
            prompts, params = runs[mode]
            if mode.startswith("new tools"):
                engine.reset_prefix_cache()
                engine.scheduler.share_inflight_prefixes = mode.endswith("on")
            before, began = engine.structured.mask_seconds, time.perf_counter()
            computed_before = engine.num_computed_tokens
            engine.generate(prompts, params)
            rate[mode] = tokens / (time.perf_counter() - began)
            computed[mode] = engine.num_computed_tokens - computed_before
            engine.scheduler.share_inflight_prefixes = True
            if mode == "tools":
                mask = engine.structured.mask_seconds - before
        print(json.dumps({"pair": pair, "requests": n, "output_tokens": tokens,
                          **{f"{m} tok/s": round(r, 1) for m, r in rate.items()},
                          "tools / chat": round(rate["tools"] / rate["chat"], 3),
                          "tools / same prompt": round(rate["tools"] / rate["same prompt"], 3),
                          "new tools on / chat": round(rate["new tools, holds on"]
                                                       / rate["chat"], 3),
                          "new tools off / chat": round(rate["new tools, holds off"]
                                                        / rate["chat"], 3),
                          **{f"{m} computed tokens": c for m, c in computed.items()},
                          "grammar mask s": round(mask, 2),
                          "tools s": round(tokens / rate["tools"], 1)}), flush=True)


def ttft(engine: Engine, pairs: int) -> None:
    """Median time to first token of one chat: with a new tool set, a cached one, the same
    tools' prompt uncached (grammar compiled), and without tools (cached and not)."""
    ask = [{"role": "user", "content": QUESTIONS[0]}]
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict[str, list[float]] = {}
    for pair in range(pairs):
        tools = [{**WEATHER, "function": {**WEATHER["function"],
                                          "description": f"The weather in a city ({pair})."}},
                 ADD, {**ORDER, "function": {**ORDER["function"], "name": f"order_{pair}"}}]
        params = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs={
            "tools": {"tools": tools, "tool_choice": "required"}})
        for mode, reset, p in (("chat not cached", True, plain), ("chat", False, plain),
                               ("new tools", False, params), ("cached tools", False, params),
                               ("tools prompt not cached", True, params)):
            if reset:
                engine.reset_prefix_cache()
            times.setdefault(mode, []).append(first_token_s(engine, ask, p))
    med = {m: 1000 * statistics.median(t) for m, t in times.items()}
    print(json.dumps({"pairs": pairs, **{f"{m} ttft ms": round(v, 1) for m, v in med.items()},
                      "added ttft new tools ms": round(med["new tools"] - med["chat not cached"],
                                                       1),
                      "added ttft cached tools ms": round(med["cached tools"] - med["chat"], 1),
                      "added ttft tools prompt not cached ms": round(
                          med["tools prompt not cached"] - med["chat not cached"], 1)}),
          flush=True)


def first_token_s(engine: Engine, ask: list[dict], params: SamplingParams) -> float:
    """Seconds from rendering the chat to its first token (max_tokens=1: its only one)."""
    began = time.perf_counter()
    engine.chat([ask], params)
    return time.perf_counter() - began


def valid_calls(engine: Engine, args: argparse.Namespace) -> None:
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
