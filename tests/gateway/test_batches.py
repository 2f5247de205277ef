"""Files and Batch API end to end on a tiny model: answers equal direct requests, a malformed
line fails alone, cancel, listing, files on disk, and ``pagedq batch`` offline."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import openai
import pytest

from tests.gateway.harness import serve, wait_until

PROMPTS = ["Hello", "The capital of France", "Queues and workers", "Tell me about Rome"]


def chat_line(custom_id: str, prompt: str, max_tokens: int = 12, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL["id"], "messages": [{"role": "user", "content": prompt}],
                     "max_tokens": max_tokens, "temperature": 0, **extra}}


MODEL: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _model(tiny_id):
    MODEL["id"] = tiny_id


def jsonl(rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def wait_batch(client: openai.OpenAI, bid: str, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(bid)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < end, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.1)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines()]


def line_error(line: dict) -> tuple[int | None, str]:
    """An error line's (status code, error code): the HTTP answer in ``response`` of a line
    that was a request, or (None, code) for one that never was (``"response": null``)."""
    if line["response"] is None:
        return None, line["error"]["code"]
    assert line["error"] is None, line
    return line["response"]["status_code"], line["response"]["body"]["error"]["code"]


def direct(client: openai.OpenAI, prompt: str, max_tokens: int = 12) -> str:
    return client.chat.completions.create(
        model=MODEL["id"], messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0).choices[0].message.content


def test_files_api(redis_url, queue, tiny_worker):
    with serve(redis_url, queue=queue, max_file_bytes=1000) as gw:
        client = gw.openai()
        data = jsonl([chat_line("a", "Hello")])
        f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        assert (f.bytes, f.filename, f.purpose, f.object) == (len(data), "in.jsonl", "batch", "file")
        assert f.expires_at - f.created_at == gw.config.files_ttl
        assert client.files.retrieve(f.id).id == f.id
        assert client.files.content(f.id).content == data
        assert f.id in [x.id for x in client.files.list()]
        assert client.files.delete(f.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.content(f.id)
        with pytest.raises(openai.APIStatusError) as err:
            client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 2000)), purpose="batch")
        assert err.value.status_code == 413
        with pytest.raises(openai.BadRequestError):
            client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="fine-tune")


def test_batch_answers_equal_direct_requests_and_bad_lines_fail_alone(redis_url, queue,
                                                                      tiny_worker):
    rows = [chat_line(f"ok-{i}", p) for i, p in enumerate(PROMPTS)]
    rows.insert(1, b"{this is not json")
    rows.insert(3, chat_line("bad-temp", "Hello", temperature=-2))
    rows.append({**chat_line("wrong-url", "Hello"), "url": "/v1/completions"})
    rows.append({**chat_line("too-long", " ".join(["Paris"] * 400))})  # refused by the worker
    with serve(redis_url, queue=queue, batch_window=2) as gw:
        client = gw.openai()
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"run": "t"})
        assert batch.status == "validating" and batch.metadata == {"run": "t"}
        batch = wait_batch(client, batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {"total": 8, "completed": 4, "failed": 4}
        out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
        answers = {p: direct(client, p) for p in PROMPTS}
    assert [o["custom_id"] for o in out] == [f"ok-{i}" for i in range(4)]
    for o, prompt in zip(out, PROMPTS, strict=True):
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["id"].startswith("batch_req_")
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] > 0
        assert body["choices"][0]["message"]["content"] == answers[prompt]
    # A line the gateway refuses carries the HTTP route's answer (400 and its error body, as
    # OpenAI writes a line's bad params); only a line that never was a request has none.
    assert {e["custom_id"]: line_error(e) for e in err} == {
        None: (None, "invalid_json_line"), "bad-temp": (400, "invalid_params"),
        "wrong-url": (None, "mismatched_url"), "too-long": (400, "prompt_too_long")}


def test_cancel_and_list(redis_url, queue, tiny_worker):
    rows = [chat_line(f"l{i}", PROMPTS[i % 4], max_tokens=200, ignore_eos=True)
            for i in range(12)]
    with serve(redis_url, queue=queue, batch_window=1) as gw:
        client = gw.openai()
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
        ids = [client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h").id for _ in range(3)]
        wait_until(lambda: client.batches.retrieve(ids[0]).request_counts.completed >= 1, 60,
                   "a first line")
        cancelled = client.batches.cancel(ids[0])
        assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
        for bid in ids[1:]:
            client.batches.cancel(bid)
        done = [wait_batch(client, bid) for bid in ids]
        assert [b.status for b in done] == ["cancelled"] * 3
        assert 1 <= done[0].request_counts.completed < 12
        assert len(read_lines(client, done[0].output_file_id)) == done[0].request_counts.completed
        page = client.batches.list(limit=2)
        assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
        rest = client.batches.list(limit=2, after=page.data[-1].id)
        assert ids[0] in [b.id for b in rest.data]
        with pytest.raises(openai.BadRequestError):
            client.batches.cancel(ids[0])


def test_files_dir_store(redis_url, queue, tiny_worker, tmp_path):
    with serve(redis_url, queue=queue, files_dir=str(tmp_path)) as gw:
        client = gw.openai()
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a", "Hello")]))),
                                purpose="batch")
        assert (tmp_path / f"{f.id}.data").is_file()
        batch = wait_batch(client, client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
        assert batch.status == "completed" and (tmp_path / f"{batch.output_file_id}.data").is_file()
        (line,) = read_lines(client, batch.output_file_id)
        assert line["response"]["body"]["choices"][0]["message"]["content"] == direct(client,
                                                                                    "Hello")


def test_offline_batch_command(redis_url, queue, tiny_worker, tmp_path):
    rows = [chat_line(f"c{i}", p) for i, p in enumerate(PROMPTS)] + [b"[]"]
    rows.append({"custom_id": "comp", "method": "POST", "url": "/v1/completions",
                 "body": {"model": MODEL["id"], "prompt": "Paris", "max_tokens": 5,
                          "temperature": 0}})
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(jsonl(rows))
    proc = subprocess.run([sys.executable, "-m", "pagedq.worker.cli", "batch", str(src), "-o",
                           str(dst), "--redis-url", redis_url, "--queue", queue],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr  # one line failed
    assert json.loads(proc.stdout.strip().splitlines()[-1])["succeeded"] == 5
    assert "line/s" in proc.stderr or "100%" in proc.stderr  # the progress bar
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(4)] + [None, "comp"]
    with serve(redis_url, queue=queue) as gw:
        client = gw.openai()
        for o, prompt in zip(out[:4], PROMPTS, strict=True):
            assert o["response"]["body"]["choices"][0]["message"]["content"] == direct(client,
                                                                                        prompt)
        comp = client.completions.create(model=MODEL["id"], prompt="Paris", max_tokens=5,
                                         temperature=0)
    assert out[5]["response"]["body"]["choices"][0]["text"] == comp.choices[0].text
    assert line_error(out[4]) == (None, "invalid_json_line")
