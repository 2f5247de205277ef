"""Faults the HTTP client must not see: a worker SIGKILLed mid-stream (another worker continues
the same stream; the answer equals a clean run's, greedy), and a gateway SIGKILLed mid-batch
(another gateway takes the batch over from Redis; no line lost or doubled)."""

from __future__ import annotations

import io
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import openai
import redis

from pagedq.client.protocol import Keys, decode_event
from tests.gateway.harness import serve, spawn_gateway, wait_until
from tests.gateway.test_batches import jsonl, read_lines, wait_batch
from tests.service.harness import running_worker
from tests.service.test_worker_procs import spawn, stop, wait_serving

B_ENGINE = dict(num_kv_blocks=160, max_num_seqs=2, max_model_len=512)  # as the process's


def test_worker_sigkilled_mid_stream_the_http_stream_completes_exactly(redis_url, tiny_model,
                                                                      tiny_id, tmp_path):
    """Worker A (a process) starts the stream and is SIGKILLed at its first token; worker B
    (in this process, the same engine knobs) starts, reclaims the job and continues the same
    output stream. The HTTP client just sees its stream go on."""
    queue = "gw-kill"
    r = redis.Redis.from_url(redis_url)
    a = spawn(redis_url, tiny_model, "A", queue, tmp_path)
    args = dict(model=tiny_id, messages=[{"role": "user", "content": "Tell me about Rome"}],
                max_tokens=240, temperature=0, extra_body={"ignore_eos": True})
    with ExitStack() as stack:
        stack.callback(stop, a)
        wait_serving(r, Keys(queue), "A", a)
        client = stack.enter_context(serve(redis_url, queue=queue)).openai()
        stream = client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **args)
        text, usage = "", None
        for n, chunk in enumerate(stream):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
            if n == 1:
                assert r.hget(Keys(queue).state(chunk.id), "owner") == b"A"
                a.send_signal(signal.SIGKILL)
                assert a.wait(10) == -signal.SIGKILL
                stack.enter_context(running_worker(redis_url, tiny_model, "B", queue=queue,
                                                   engine=B_ENGINE))
        events = raw_events(r, Keys(queue), chunk.id)
        clean = client.chat.completions.create(**args)
    assert [e.worker for e in events][0] == "A" and events[-1].worker == "B"  # a real takeover
    assert usage.completion_tokens == 240 == clean.usage.completion_tokens
    assert text == clean.choices[0].message.content


def raw_events(r, keys, rid):
    return [decode_event(f, i) for i, f in r.xrange(keys.out(rid))]


def test_gateway_sigkilled_mid_batch_another_takes_over(redis_url, tiny_model, tiny_id,
                                                        tmp_path):
    queue = "gw-restart"
    prompts = [f"Tell me about city number {i}" for i in range(8)]
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": tiny_id, "messages": [{"role": "user", "content": p}],
                      "max_tokens": 60, "temperature": 0, "ignore_eos": True}}
            for i, p in enumerate(prompts)]
    with running_worker(redis_url, tiny_model, "restart-w", queue=queue):
        first, base = spawn_gateway(redis_url, tmp_path / "gw1.log", "--queue", queue,
                                    "--batch-lease", "1", "--batch-window", "2")
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
            bid = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                        completion_window="24h").id

            def two_done() -> bool:
                batch = client.batches.retrieve(bid)
                assert batch.request_counts.failed == 0, (batch, (tmp_path / "gw1.log").read_text())
                return batch.request_counts.completed >= 2

            wait_until(two_done, 300, "two lines done")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        with serve(redis_url, queue=queue, batch_lease=1.0) as gw:
            client = gw.openai()
            assert client.batches.retrieve(bid).request_counts.completed < 8  # mid-batch
            batch = wait_batch(client, bid, timeout=300)
            out = read_lines(client, batch.output_file_id)
            with ThreadPoolExecutor(4) as pool:
                direct = list(pool.map(lambda p: client.chat.completions.create(
                    model=tiny_id, messages=[{"role": "user", "content": p}], max_tokens=60,
                    temperature=0, extra_body={"ignore_eos": True}).choices[0].message.content,
                    prompts))
    assert batch.status == "completed" and batch.error_file_id is None
    assert batch.request_counts.completed == 8 and batch.request_counts.failed == 0
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(8)]
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == direct
