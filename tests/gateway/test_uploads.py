"""Uploads against a real gateway and a real Redis (issue 25): the file goes to the store in
pieces as it arrives, the limits (file size, the key's quota, the gateway's quota over all keys)
stop an upload while it is being read, and a full Redis is a 503, never a 500."""

from __future__ import annotations

import io
import socket

import openai
import pytest
import redis
from structlog.testing import capture_logs

from pagedq.embedded_redis import EmbeddedRedis
from tests.gateway.harness import serve, wait_until

BOUNDARY = b"pagedqtestboundary"
FORM_HEAD = (b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
             b"batch\r\n--" + BOUNDARY +
             b'\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
             b"Content-Type: application/octet-stream\r\n\r\n")


class ChunkedUpload:
    """A client that sends an upload with chunked transfer encoding at its own pace (no
    Content-Length: the gateway only learns the size by reading), and may stop mid-body."""

    def __init__(self, base: str, key: str | None = None):
        port = int(base.rsplit(":", 1)[1])
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
        self.sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
                          b"Transfer-Encoding: chunked\r\nContent-Type: multipart/form-data; "
                          b"boundary=" + BOUNDARY + b"\r\n\r\n")
        self.send(FORM_HEAD)

    def send(self, data: bytes) -> None:
        self.sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))

    def finish(self) -> None:
        self.send(b"\r\n--" + BOUNDARY + b"--\r\n")
        self.sock.sendall(b"0\r\n\r\n")

    def status(self) -> tuple[int, bytes]:
        """The answer's status and the whole answer (its body by Content-Length): the test
        blocks here until the gateway answers."""
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < int(
                reply.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):
            chunk = self.sock.recv(65536)
            assert chunk, f"closed without an answer: {reply!r}"
            reply += chunk
        return int(reply.split(b" ", 2)[1]), reply

    def close(self) -> None:
        self.sock.close()


def part_keys(redis_url: str) -> list[bytes]:
    """An unfinished upload's bytes: a file's data key with no meta beside it."""
    r = redis.Redis.from_url(redis_url)
    try:
        return [k for k in r.keys("*:gw:file:*:data") if not r.exists(k[:-len(b":data")])]
    finally:
        r.close()


def clear_files(client: openai.OpenAI) -> None:
    for f in client.files.list():  # the session's Redis outlives a test
        client.files.delete(f.id)


@pytest.mark.parametrize("files_dir", [False, True])
def test_an_upload_is_stored_in_pieces_and_cut_off_at_its_limit(redis_url, tmp_path, files_dir):
    """Half an upload is already in the store while the client still sends; one byte past
    --max-file-bytes is answered 413 while the client still holds the rest, and what was
    written is dropped."""
    limit = 3 << 20
    overrides = {"files_dir": str(tmp_path / "files")} if files_dir else {}
    with serve(redis_url, queue="uploads", max_file_bytes=limit, **overrides) as gw:
        up = ChunkedUpload(gw.base)
        for _ in range(2):
            up.send(b"x" * (1 << 20))
        if files_dir:
            parts = lambda: list((tmp_path / "files").glob(".file-*.part.*"))  # noqa: E731
            wait_until(lambda: parts() and parts()[0].stat().st_size >= 1 << 20, 60,
                       "the first megabyte in the directory")
        else:
            wait_until(lambda: part_keys(redis_url), 60, "the first megabyte in Redis")
        up.send(b"x" * (limit - (2 << 20) + 1))  # one byte past the limit; the body goes on
        code, reply = up.status()
        up.close()
        assert code == 413 and b"request_too_large" in reply
        wait_until(lambda: not part_keys(redis_url), 30, "the partial upload's removal")
        if files_dir:
            assert not list((tmp_path / "files").glob(".file-*"))
        whole = ChunkedUpload(gw.base)
        whole.send(b'{"a": 1}\n' * 1000)
        whole.finish()
        code, reply = whole.status()
        whole.close()
        assert code == 200 and b'"bytes":9000' in reply.replace(b" ", b"")


def test_the_gateways_quota_counts_every_key(redis_url):
    """Per-key quotas alone let many keys fill Redis: --max-total-files and
    --max-total-files-bytes hold all keys together, and an upload past what is left stops
    while it is read."""
    with serve(redis_url, queue="uploads", api_keys=("ka", "kb"), admin_keys=("root",),
               max_files=3, max_files_bytes=10_000, max_total_files=3,
               max_total_files_bytes=12_000) as gw:
        a, b = gw.openai("ka"), gw.openai("kb")
        clear_files(gw.openai("root"))
        a.files.create(file=("a1.jsonl", io.BytesIO(b"{}\n" * 2000)), purpose="batch")  # 6,000
        b.files.create(file=("b1.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        up = ChunkedUpload(gw.base, "kb")  # b's own quota leaves 9,997; the gateway's 5,997
        up.send(b"x" * 7000)
        code, reply = up.status()
        up.close()
        assert code == 403 and b"all keys together" in reply and b"--max-total-files" in reply
        wait_until(lambda: not part_keys(redis_url), 30, "the partial upload's removal")
        b.files.create(file=("b2.jsonl", io.BytesIO(b"{}\n" * 100)), purpose="batch")
        with pytest.raises(openai.PermissionDeniedError) as err:  # 3 files in all
            b.files.create(file=("b3.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        assert err.value.code == "quota_exceeded" and "all keys together" in str(err.value)
        assert len(b.files.list().data) == 2 and len(a.files.list().data) == 1
        clear_files(gw.openai("root"))


def test_a_full_redis_is_a_503_and_the_partial_upload_goes(tmp_path):
    """A Redis at maxmemory (noeviction) refuses the upload's next piece: the client gets 503
    storage_full with Retry-After, not a 500, and the queue's Redis keeps nothing of it. The
    gateway logs it as one warning line, no traceback (one per refused request adds up)."""
    with EmbeddedRedis.start(unix_socket=True, maxmemory=24 << 20) as server, \
            serve(server.url, queue="uploads", max_file_bytes=64 << 20) as gw, \
            gw.http() as http:
        with capture_logs() as logs:
            resp = http.post("/v1/files", files={"file": ("big.jsonl", b"x" * (40 << 20))},
                             data={"purpose": "batch"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "storage_full"
        refused = [e for e in logs if e.get("path") == "/v1/files"]
        assert [(e["log_level"], e.get("code")) for e in refused] == [
            ("warning", "storage_full")], logs
        assert not [e for e in logs if e.get("exc_info")], logs
        assert resp.headers["retry-after"]
        wait_until(lambda: not part_keys(server.url), 30, "the partial upload's removal")
        small = http.post("/v1/files", files={"file": ("s.jsonl", b"{}\n")},
                          data={"purpose": "batch"})
        assert small.status_code == 200  # the gateway and its Redis are fine afterwards


def test_malformed_forms_are_400(redis_url):
    with serve(redis_url, queue="uploads") as gw, gw.http() as http:
        cases = {
            "not a form": dict(content=b"{}", headers={"Content-Type": "application/json"}),
            "no boundary": dict(content=b"x", headers={"Content-Type": "multipart/form-data"}),
            "no file": dict(files={"purpose": (None, b"batch")}),
            "file under another name": dict(files={"f": ("a.jsonl", b"{}\n")},
                                            data={"purpose": "batch"}),
            "two files": dict(files=[("file", ("a.jsonl", b"{}\n")),
                                     ("file", ("b.jsonl", b"{}\n"))], data={"purpose": "batch"}),
            "bad purpose": dict(files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "x"}),
            "huge field": dict(files={"file": ("a.jsonl", b"{}\n")},
                               data={"purpose": "b" * 5000}),
            "broken body": dict(content=b"--XX\r\nnonsense",
                                headers={"Content-Type": "multipart/form-data; boundary=XX"}),
            "cut short": dict(content=b'--XX\r\nContent-Disposition: form-data; name="purpose"'
                                      b'\r\n\r\nbatch\r\n--XX\r\nContent-Disposition: '
                                      b'form-data; name="file"; filename="cut.jsonl"\r\n\r\n'
                                      b'{"a": 1}\n{"b"',
                              headers={"Content-Type": "multipart/form-data; boundary=XX"}),
        }
        for name, kw in cases.items():
            resp = http.post("/v1/files", **kw)
            assert resp.status_code == 400, (name, resp.status_code, resp.text[:300])
        assert not part_keys(redis_url)
        assert not [f for f in http.get("/v1/files").json()["data"]
                    if f["filename"] == "cut.jsonl"]  # no truncated file kept
        assert 'status="500"' not in http.get("/metrics").text


def fill(r: redis.Redis, start: int = 0) -> list[str]:
    """Fill a noeviction Redis until even a small write is refused (a refused big value leaves
    room: its own query buffer counted); the keys written (``junk:<start>`` on)."""
    keys: list[str] = []
    for size in (1 << 20, 1 << 14, 1 << 8):
        try:
            while True:
                r.set(f"junk:{start + len(keys)}", b"x" * size)
                keys.append(f"junk:{start + len(keys)}")
        except redis.exceptions.OutOfMemoryError:
            pass
    return keys


def test_a_chat_request_at_a_full_redis_is_a_503_that_quotes_no_command(tiny_model, tiny_id):
    """Medium-3 and Low-1: at maxmemory a chat request once got a 500 whose body began the
    refused Redis command; now 503 storage_full with Retry-After, and once room is made the
    same request is answered."""
    from tests.service.harness import running_worker

    body = {"model": tiny_id, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 2}
    with EmbeddedRedis.start(unix_socket=True, maxmemory=32 << 20) as server, \
            running_worker(server.url, tiny_model, "oom-w", queue="oom"), \
            serve(server.url, queue="oom") as gw, gw.http() as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        r = redis.Redis.from_url(server.url)
        junk = fill(r)
        for _ in range(5):  # memory freed meanwhile (a key of the first request expiring) lets
            resp = http.post("/v1/chat/completions", json=body)  # the job in: fill again
            if resp.status_code != 200:
                break
            junk += fill(r, start=len(junk))
        assert resp.status_code == 503, resp.text[:300]
        assert resp.json()["error"]["code"] == "storage_full" and resp.headers["retry-after"]
        assert "OOM" not in resp.text and "XADD" not in resp.text.upper()
        r.delete(*junk)
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        r.close()
