"""``pagedq serve`` against hostile and careless clients (issue 25): every finding's repro,
each answered as it must be now (a bad line fails alone, a bad body is a 400, ...)."""

from __future__ import annotations

import io
import json

import pytest
import redis

from pagedq.gateway.batch_store import BatchKeys
from tests.gateway.harness import serve, wait_until
from tests.gateway.test_batches import (
    MODEL,
    chat_line,
    jsonl,
    line_error,
    read_lines,
    wait_batch,
)


@pytest.fixture(autouse=True)
def _model(tiny_id):
    MODEL["id"] = tiny_id


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def bad_bodies(model: str) -> dict[str, dict]:
    """Bodies that each once answered 500 (and stalled every batch holding one as a line)."""
    hello = [{"role": "user", "content": "Hello"}]
    return {
        "n17": {"model": model, "messages": hello, "n": 17},
        "stop17": {"model": model, "messages": hello, "stop": [f"s{i}" for i in range(17)]},
        "stop300": {"model": model, "messages": hello, "stop": ["x" * 300]},
        "surrogate": {"model": model, "messages": [{"role": "user", "content": "\ud800"}]},
        "nested300": {"model": model, "messages": hello,
                      "response_format": {"type": "json_schema", "json_schema": {
                          "name": "deep", "schema": nested_schema(300)}}},
        "nested450": {"model": model, "messages": hello,
                      "response_format": {"type": "json_schema", "json_schema": {
                          "name": "deep", "schema": nested_schema(450)}}},
        "patterns450": {"model": model, "messages": hello,  # a ~30 KB schema bomb
                        "response_format": {"type": "json_schema", "json_schema": {
                            "name": "bomb", "schema": schema_bomb()}}},
    }


def schema_bomb() -> dict:
    """anyOf 30 objects x 15 pattern strings: ~34 s of compiling for SmolLM2's vocabulary."""
    return {"anyOf": [{"type": "object", "properties": {
        f"p{i}_{j}": {"type": "string", "pattern": f"^[a-z]{{3,40}}[0-9]{{{j}}}$"}
        for j in range(15)}} for i in range(30)]}


def test_bad_lines_fail_alone_and_never_stall_a_batch(redis_url, queue, tiny_worker, tiny_id):
    """Each bad line gets one 400-style error line; its batch completes, the batches beside it
    run, an unserved model's line is refused and not also answered, a cancel ends as cancelled."""
    bad = bad_bodies(tiny_id)
    rows = [chat_line("ok-0", "Hello", max_tokens=4)]
    rows += [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions", "body": body}
             for name, body in bad.items()]
    rows.append({**chat_line("unserved", "Hello", max_tokens=4),
                 "body": {**chat_line("x", "Hello")["body"], "model": "gpt-4o"}})
    rows.append(chat_line("ok-1", "Rome", max_tokens=4))
    long = [chat_line(f"l{i}", "Hello", max_tokens=200, ignore_eos=True) for i in range(6)]
    with serve(redis_url, queue=queue, batch_window=2) as gw:
        client = gw.openai()
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
        g = client.files.create(file=("long.jsonl", io.BytesIO(jsonl(long + rows))),
                                purpose="batch")
        ids = [client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h").id for _ in range(3)]
        doomed = client.batches.create(input_file_id=g.id, endpoint="/v1/chat/completions",
                                       completion_window="24h").id
        wait_until(lambda: client.batches.retrieve(doomed).request_counts.completed >= 1, 120,
                   "a first line of the batch to cancel")
        client.batches.cancel(doomed)
        assert wait_batch(client, doomed).status == "cancelled"
        for bid in ids:
            batch = wait_batch(client, bid)
            assert batch.status == "completed", batch
            assert batch.request_counts.model_dump() == {
                "total": len(rows), "completed": 2, "failed": len(bad) + 1}
            out = read_lines(client, batch.output_file_id)
            err = read_lines(client, batch.error_file_id)
            assert sorted(o["custom_id"] for o in out) == ["ok-0", "ok-1"]
            assert sorted(e["custom_id"] for e in err) == sorted([*bad, "unserved"])
            for e in err:  # each the answer its HTTP route gives (test_bad_bodies_are_400...)
                assert e["response"]["request_id"], e
                assert len(e["response"]["body"]["error"]["message"]) < 600, e
            codes = {e["custom_id"]: line_error(e) for e in err}
            assert codes == {"unserved": (404, "model_not_found"),
                             "surrogate": (400, "invalid_request"),
                             **{k: (400, "invalid_params") for k in (
                                 "n17", "stop17", "stop300", "nested300", "nested450",
                                 "patterns450")}}


def test_a_batch_whose_driving_raises_does_not_hold_the_others(redis_url, queue, tiny_worker):
    """A batch whose state is corrupt (here: its record lost a field) is failed after a few
    passes, and a batch beside it completes in the meantime."""
    with serve(redis_url, queue=queue) as gw:
        client = gw.openai()
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a", "Hi", 4)]))),
                                purpose="batch")
        broken = "batch_0000broken"  # sorts before every batch the API makes
        obj = {"id": broken, "object": "batch", "endpoint": "/v1/chat/completions",
               "input_file_id": f.id, "status": "validating"}  # no expires_at
        keys = BatchKeys(gw.config.prefix, queue)
        r = redis.Redis.from_url(redis_url)
        pipe = r.pipeline()
        pipe.hset(keys.batch(broken), mapping={"obj": json.dumps(obj), "next": 0})
        pipe.zadd(keys.index, {broken: 0})
        pipe.sadd(keys.active, broken)
        pipe.execute()
        fine = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h").id
        assert wait_batch(client, fine).status == "completed"
        failed = wait_batch(client, broken)
        assert failed.status == "failed" and failed.errors.data[0].code == "internal"


@pytest.mark.parametrize("name", list(bad_bodies("m")))
def test_bad_bodies_are_400_not_500(redis_url, queue, tiny_worker, tiny_id, name):
    body = bad_bodies(tiny_id)[name]
    with serve(redis_url, queue=queue) as gw, gw.http() as http:
        resp = http.post("/v1/chat/completions", content=json.dumps(body),
                         headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert len(resp.text) < 1000 and "Traceback" not in resp.text


def test_an_error_quotes_a_huge_body_briefly_and_a_listing_is_capped(redis_url, queue,
                                                                   tiny_worker, tiny_id):
    """Low-5 and Medium-3: 100k stop strings once echoed a 989 KB error (now cut at 400
    characters of what the client sent), and a batch listing may not ask past 100."""
    body = {"model": tiny_id, "messages": [{"role": "user", "content": "Hi"}],
            "stop": [f"stop-{i}" for i in range(100_000)]}
    with serve(redis_url, queue=queue) as gw, gw.http() as http:
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and len(resp.content) < 1000, resp.text[:300]
        assert resp.json()["error"]["code"] == "invalid_params"
        assert http.get("/v1/batches", params={"limit": 101}).status_code == 400
        assert http.get("/v1/batches", params={"limit": 100}).status_code == 200


def test_a_bad_last_event_id_is_400(redis_url, queue, tiny_worker, tiny_id):
    body = {"model": tiny_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "stream": True}
    with serve(redis_url, queue=queue) as gw, gw.http() as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            rid = next(json.loads(ln[6:])["id"] for ln in resp.iter_lines()
                       if ln.startswith("data: {"))
        for bad in ("\xb2".encode("latin-1"), b"9" * 5000, b"-1", b"1e3"):
            resp = http.get(f"/v1/requests/{rid}/stream", headers={"Last-Event-ID": bad})
            assert resp.status_code == 400, (bad[:10], resp.text)
            assert resp.json()["error"]["param"] == "Last-Event-ID"


@pytest.mark.parametrize("files_dir", [False, True])
def test_odd_file_and_batch_ids_are_404_and_echo_no_path(redis_url, queue, tiny_worker, tmp_path,
                                                        files_dir):
    overrides = {"files_dir": str(tmp_path / "files")} if files_dir else {}
    with serve(redis_url, queue=queue, **overrides) as gw, gw.http() as http:
        if files_dir:  # a stray record beside the gateway's own: listed as nothing
            (tmp_path / "files" / "notes.json").write_text('{"hello": 1}')
            (tmp_path / "files" / "file-stray.json").write_text("[1, 2]")
        assert http.get("/v1/files").status_code == 200
        for fid in ("file-%00", "file-" + "a" * 5000, "..%2F..%2Fetc", "file-stray", "notes"):
            for method, path in (("GET", f"/v1/files/{fid}"), ("GET", f"/v1/files/{fid}/content"),
                                 ("DELETE", f"/v1/files/{fid}")):
                resp = http.request(method, path)
                assert resp.status_code == 404, (method, fid[:20], resp.text[:200])
                assert str(tmp_path) not in resp.text and len(resp.text) < 1000
        for bid in ("batch_%00", "batch_" + "b" * 5000):
            assert http.get(f"/v1/batches/{bid}").status_code == 404
            assert http.post(f"/v1/batches/{bid}/cancel").status_code == 404


def test_a_client_dropped_mid_upload_is_no_server_error(redis_url, queue, tiny_worker):
    import socket

    with serve(redis_url, queue=queue) as gw:
        port = int(gw.base.rsplit(":", 1)[1])
        head = (b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n"
                b"Content-Type: multipart/form-data; boundary=XX\r\n\r\n"
                b'--XX\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n')
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(head + b"x" * 1000)
        with gw.http() as http:
            wait_until(lambda: 'route="/v1/files"' in http.get("/metrics").text, 30,
                       "the upload's end")
            metrics = http.get("/metrics").text
        assert 'route="/v1/files",status="499"' in metrics
        assert 'status="500"' not in metrics


def test_prompts_per_request_are_capped_and_each_counts_against_the_depth(
        redis_url, queue, tiny_worker, tiny_id):
    with serve(redis_url, queue=queue) as gw, gw.http() as http:
        resp = http.post("/v1/completions", json={"model": tiny_id, "prompt": [[1]] * 2049,
                                                  "max_tokens": 1})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "too_many_prompts"
    with serve(redis_url, queue=queue, max_queue_depth=5) as gw, gw.http() as http:
        resp = http.post("/v1/completions", json={"model": tiny_id, "prompt": [[1]] * 200,
                                                  "max_tokens": 1})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "too_many_prompts"
        resp = http.post("/v1/completions", json={"model": tiny_id, "prompt": [[1, 2]] * 5,
                                                  "max_tokens": 1, "temperature": 0})
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 5


def test_a_clients_priority_is_clamped_to_the_allowed_range(redis_url, queue, tiny_worker,
                                                            tiny_id):
    r = redis.Redis.from_url(redis_url)
    body = {"model": tiny_id, "prompt": "Hi", "max_tokens": 1, "priority": -1_000_000}
    for flags, level in (({}, "normal"), ({"min_priority": -5}, "high")):
        with serve(redis_url, queue=queue, **flags) as gw, gw.http() as http:
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            state = f"{gw.config.prefix}:{{{queue}}}:req:{resp.json()['id']}:state"
            assert r.hget(state, "stream").decode().endswith(f":jobs:{level}"), flags
    with serve(redis_url, queue=queue) as gw, gw.http() as http:  # past the wire's bound
        resp = http.post("/v1/completions", json={**body, "priority": 10**12})
        assert resp.status_code == 200
        state = f"{gw.config.prefix}:{{{queue}}}:req:{resp.json()['id']}:state"
        assert r.hget(state, "stream").decode().endswith(":jobs:low")


def test_each_key_is_a_tenant_and_an_admin_key_sees_all(redis_url, queue, tiny_worker, tiny_id):
    import openai

    with serve(redis_url, queue=queue, api_keys=("key-a", "key-b"),
               admin_keys=("key-admin",)) as gw:
        a, b, admin = gw.openai("key-a"), gw.openai("key-b"), gw.openai("key-admin")
        f = a.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("x", "Hi", 2)]))),
                           purpose="batch")
        batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        stream = a.chat.completions.create(model=tiny_id, max_tokens=2, stream=True,
                                           messages=[{"role": "user", "content": "Hi"}])
        rid = next(iter(stream)).id
        list(stream)
        done = wait_batch(a, batch.id)
        assert done.status == "completed" and read_lines(a, done.output_file_id)
        for fid in (f.id, done.output_file_id):
            for call in (b.files.retrieve, b.files.content, b.files.delete):
                with pytest.raises(openai.NotFoundError):
                    call(fid)
            assert fid not in [x.id for x in b.files.list()]
            assert fid in [x.id for x in admin.files.list()]
            assert admin.files.retrieve(fid).id == fid
        for call in (b.batches.retrieve, b.batches.cancel):
            with pytest.raises(openai.NotFoundError):
                call(batch.id)
        assert batch.id not in [x.id for x in b.batches.list()]
        assert batch.id in [x.id for x in a.batches.list()]
        assert admin.batches.retrieve(batch.id).id == batch.id
        with pytest.raises(openai.BadRequestError):  # B cannot run a batch on A's file
            b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                             completion_window="24h")
        with gw.http() as http:
            path = f"/v1/requests/{rid}/stream"
            assert http.get(path, headers={"Authorization": "Bearer key-b"}).status_code == 404
            for key in ("key-a", "key-admin"):
                resp = http.get(path, headers={"Authorization": f"Bearer {key}"})
                assert resp.status_code == 200 and "[DONE]" in resp.text
            assert http.get("/openapi.json").status_code == 401
        assert not r_keys_hold(redis_url, b"key-a")


def r_keys_hold(redis_url: str, secret: bytes) -> bool:
    """Whether any gateway record in Redis holds ``secret`` (the keys are stored hashed)."""
    r = redis.Redis.from_url(redis_url)
    for key in r.scan_iter(match="*:gw*"):
        if r.type(key) == b"hash" and any(secret in v for v in r.hgetall(key).values()):
            return True
    return False


def test_foreign_hosts_and_origins_are_refused(redis_url, queue, tiny_worker):
    with serve(redis_url, queue=queue, allowed_hosts=["gw.internal"]) as gw, gw.http() as http:
        port = gw.base.rsplit(":", 1)[1]
        for host, status in (("evil.example", 421), (f"evil.example:{port}", 421),
                             (f"localhost:{port}", 200), (f"127.0.0.1:{port}", 200),
                             ("gw.internal", 200), (f"[::1]:{port}", 200), ("10.1.2.3", 200)):
            assert http.get("/v1/models", headers={"Host": host}).status_code == status, host
        for origin, status in (("http://evil.example", 403), ("null", 403),
                               (f"http://localhost:{port}", 200), ("https://gw.internal", 200)):
            resp = http.post("/v1/files", headers={"Origin": origin},
                             files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"})
            assert resp.status_code == status, (origin, resp.text)


def test_a_burst_past_the_connection_pool_waits_rather_than_fails(redis_url, queue, tiny_worker):
    """150 concurrent reads through 4 connections: each waits for a free one (was: 500 "Too
    many connections")."""
    import asyncio

    from tests.gateway.harness import httpx

    async def burst(base: str) -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            resps = await asyncio.gather(*(http.get("/v1/batches/batch_x") for _ in range(150)))
        return [r.status_code for r in resps]

    with serve(redis_url, queue=queue, redis_max_connections=4, redis_pool_timeout=30) as gw:
        assert set(asyncio.run(burst(gw.base))) == {404}


@pytest.mark.parametrize("files_dir", [False, True])
def test_file_quotas_per_key_and_chunked_downloads(redis_url, queue, tiny_worker, tmp_path,
                                                  files_dir):
    import openai

    from pagedq.gateway.files import CHUNK

    overrides = {"files_dir": str(tmp_path / "files")} if files_dir else {}
    big = b"".join(b'{"n": %d}\n' % i for i in range(300_000))  # past two chunks
    assert len(big) > 2 * CHUNK
    with serve(redis_url, queue=queue, api_keys=("key-q", "key-r"), max_files=2,
               max_files_bytes=len(big) + 100, max_file_bytes=len(big) + 100,
               **overrides) as gw:
        q, other = gw.openai("key-q"), gw.openai("key-r")
        for f in q.files.list():  # the Redis store outlives a test
            q.files.delete(f.id)
        first = q.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="batch")
        with gw.http() as http:
            with http.stream("GET", f"/v1/files/{first.id}/content",
                             headers={"Authorization": "Bearer key-q"}) as resp:
                assert resp.headers["content-length"] == str(len(big))
                assert b"".join(resp.iter_bytes()) == big
        with pytest.raises(openai.PermissionDeniedError) as err:  # bytes
            q.files.create(file=("more.jsonl", io.BytesIO(b"{}\n" * 50)), purpose="batch")
        assert err.value.code == "quota_exceeded"
        other.files.create(file=("r.jsonl", io.BytesIO(b"{}\n")), purpose="batch")  # its own
        q.files.delete(first.id)
        for _ in range(2):
            q.files.create(file=("s.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        with pytest.raises(openai.PermissionDeniedError):  # count
            q.files.create(file=("s.jsonl", io.BytesIO(b"{}\n")), purpose="batch")


def test_batch_metadata_is_bounded_like_openais(redis_url, queue, tiny_worker):
    with serve(redis_url, queue=queue) as gw, gw.http() as http:
        up = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")},
                       data={"purpose": "batch"}).json()["id"]
        body = {"input_file_id": up, "endpoint": "/v1/chat/completions"}
        for metadata in ({str(i): "v" for i in range(17)}, {"k": "v" * 513},
                         {"k" * 65: "v"}, {"k": "v" * (3 << 20)}):
            resp = http.post("/v1/batches", json={**body, "metadata": metadata})
            assert resp.status_code in (400, 413) and len(resp.text) < 1000, resp.text[:200]
        ok = http.post("/v1/batches", json={**body, "metadata": {str(i): "v" * 512
                                                                 for i in range(16)}})
        assert ok.status_code == 200
        http.post(f"/v1/batches/{ok.json()['id']}/cancel")


def test_the_gateway_runs_under_the_documented_acl_rule(redis_url, tiny_model, tiny_id):
    """A gateway and a worker whose Redis user has acl_rule(gateway=True): files, a batch, a
    stream and its resume all work; admin commands are refused."""
    from pagedq.client.acl import acl_rule
    from tests.service.harness import running_worker

    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", *acl_rule("gw-acl", "gw-pw", prefix="gwacl",
                                                      gateway=True).split())
    host = redis_url.rsplit("@", 1)[-1] if "@" in redis_url else redis_url.split("://")[1]
    url = f"redis://gw-acl:gw-pw@{host}"
    narrow = redis.Redis.from_url(url)
    for command in (("CONFIG", "GET", "maxmemory"), ("ACL", "SETUSER", "x"), ("KEYS", "*"),
                    ("FLUSHALL",)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            narrow.execute_command(*command)
    with running_worker(url, tiny_model, "acl-w", queue="acl", prefix="gwacl"), \
            serve(url, queue="acl", prefix="gwacl") as gw:
        client = gw.openai()
        wait_until(lambda: client.models.list().data, 60, "the worker")
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a", "Hi", 2)]))),
                                purpose="batch")
        assert client.files.content(f.id).content.startswith(b'{"custom_id"')
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        done = wait_batch(client, batch.id)
        assert done.status == "completed" and read_lines(client, done.output_file_id)
        assert [b.id for b in client.batches.list()][0] == batch.id
        stream = client.chat.completions.create(model=tiny_id, max_tokens=2, stream=True,
                                                messages=[{"role": "user", "content": "Hi"}])
        rid = next(iter(stream)).id
        list(stream)
        with gw.http() as http:
            assert "[DONE]" in http.get(f"/v1/requests/{rid}/stream").text
        client.files.delete(f.id)


def test_duplicate_custom_ids_fail_the_batch_and_models_show_no_path(redis_url, queue,
                                                                    tiny_worker, tiny_model):
    rows = [chat_line("same", "Hi", 2), chat_line("other", "Hi", 2), chat_line("same", "Yo", 2)]
    # a queue of its own: a batch is driven by any gateway serving its queue, and the earlier
    # tests' gateways kept their files in a folder, where this one's input is not (a driver
    # still stopping on a loaded machine once failed it with file_not_found)
    with serve(redis_url, queue=queue + "-dup") as gw:
        client = gw.openai()
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
        batch = wait_batch(client, client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
        assert batch.status == "failed"
        assert batch.errors.data[0].code == "duplicate_custom_id"
        assert "lines 1 and 3" in batch.errors.data[0].message
    with serve(redis_url, queue=queue) as gw:  # the queue the tiny worker serves
        client = gw.openai()
        wait_until(lambda: client.models.list().data, 60, "the worker")
        with gw.http() as http:
            models = http.get("/v1/models").text
        assert tiny_model not in models and "/tmp" not in models


def test_offline_batch_fails_a_bad_line_alone(redis_url, queue, tiny_worker, tiny_id, tmp_path):
    import asyncio

    from pagedq.gateway.batch_file import run_batch
    from pagedq.worker.config import DEFAULT_PREFIX

    rows = [chat_line("ok", "Hi", 2)]
    rows += [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions", "body": body}
             for name, body in bad_bodies(tiny_id).items()]
    (tmp_path / "in.jsonl").write_bytes(jsonl(rows))
    ok, failed = asyncio.run(run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", redis_url,
                                       queue, DEFAULT_PREFIX, 4, 30, progress=False))
    assert (ok, failed) == (1, len(rows) - 1)
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [r["custom_id"] for r in rows]
