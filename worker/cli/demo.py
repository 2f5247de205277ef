"""``pagedq demo``: an embedded Redis, one worker in this process, a few streamed requests."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pagedq.worker.cli.flags import add_engine_flags, add_sampling_flags, engine_knobs, sampling_params
from pagedq.worker.cli.queue import print_event, render_stats

DEMO_PROMPTS = [
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "What is a paged KV cache?",
]
SAMPLING_DEFAULTS: dict[str, Any] = {"max_tokens": 48, "temperature": 0.0}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="embedded Redis + a worker + a few streamed requests",
                       description="Start a private redis-server and a worker in this process, "
                       "then stream a few prompts through the queue.")
    p.add_argument("prompts", nargs="*", help=f"default: {DEMO_PROMPTS}")
    add_engine_flags(p)
    add_sampling_flags(p, defaults=SAMPLING_DEFAULTS, skip=("n", "logprobs", "seed"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import threading

    from pagedq.client import Client
    from pagedq.errors import InvalidParamsError
    from pagedq.worker.config import WorkerConfig
    from pagedq.worker.logging import configure_logging
    from pagedq.worker.service.embedded_redis import EmbeddedRedis
    from pagedq.worker.service.worker import Worker

    configure_logging(json=False, level="WARNING")
    try:
        params = sampling_params(args, SAMPLING_DEFAULTS)
    except InvalidParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = engine_knobs(args)
    model = engine.pop("model", None)
    with EmbeddedRedis.start() as server:
        print(f"embedded redis-server listening on {server.url}")
        worker = Worker(WorkerConfig(model=model, redis_url=server.url, consumer_name="demo",
                                     engine=engine))
        thread = threading.Thread(target=_serve, args=(worker,), daemon=True)
        thread.start()
        print("loading the model (first use may take a while)...")
        while not worker.ready.wait(0.5):
            if not thread.is_alive():
                print("the worker failed to start; see the log above", file=sys.stderr)
                return 1
        tokenizer = worker.engine.tokenizer
        chat = tokenizer is not None and getattr(tokenizer, "chat_template", None)
        with Client(server.url) as client:
            for prompt in args.prompts or DEMO_PROMPTS:
                print(f"\n>>> {prompt}")
                handle = client.submit([{"role": "user", "content": prompt}] if chat else prompt,
                                       params)
                start = time.perf_counter()
                for ev in handle.stream(timeout=600):
                    print_event(ev, False, 1)
                print(f"   ({time.perf_counter() - start:.2f}s)")
            print("\n" + render_stats(client.stats()))
        worker.stop()
        thread.join(60)
    return 0


def _serve(worker: Any) -> None:
    import asyncio

    asyncio.run(worker.run())
