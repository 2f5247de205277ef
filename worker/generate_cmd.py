"""``pagedq generate`` and ``pagedq chat``: run the engine in-process from the terminal."""

from __future__ import annotations

import argparse
import json
import sys

from pagedq.errors import EngineError, InvalidParamsError
from pagedq.params import SamplingParams


def add_engine_arguments(p: argparse.ArgumentParser, model_default: str | None = None) -> None:
    """Engine flags shared by every command that builds an Engine (generate, chat, worker)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=model_default,
                   help="local dir, .gguf file or cached HF name (default: bundled SmolLM2-135M)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV cache dtype (auto: the model's; float16 under a float32 model on "
                   "the CPU halves attention's memory traffic)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 8 on CPU, 16 on CUDA)")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV bytes on CPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap on one prompt's chunk per step (0: the whole budget)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                device=args.device,
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory=args.kv_cache_memory,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                enable_prefix_caching=not args.no_prefix_caching,
                num_threads=args.threads)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                          n=args.n, stop=args.stop)


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate from prompts in-process (streams one prompt)")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--json", action="store_true", help="print results as JSON lines")
    add_engine_arguments(gen)
    add_sampling_arguments(gen)
    gen.set_defaults(func=run_generate, chat=False)
    chat = sub.add_parser("chat", help="like generate, with the model's chat template applied")
    chat.add_argument("prompts", nargs="+", help="user message(s), one conversation each")
    chat.add_argument("--system", default=None, help="a system message for every conversation")
    chat.add_argument("--json", action="store_true", help="print results as JSON lines")
    add_engine_arguments(chat)
    add_sampling_arguments(chat)
    chat.set_defaults(func=run_generate, chat=True)


def run_generate(args: argparse.Namespace) -> int:
    from pagedq.worker import Engine
    from pagedq.worker.logging import configure_logging

    configure_logging(level="WARNING")
    try:
        params = sampling_params(args)
        engine = Engine(**engine_kwargs(args))
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


def stream_one(engine, prompt, params: SamplingParams) -> int:
    """Print text as the engine produces it."""
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
