"""Security against real redis-servers: AUTH, an ACL user per tenant confined to its prefix,
TLS with a private CA and mutual TLS; every misconfiguration is one clear log line and exit 1,
never a traceback; credentials never reach a log line; nothing in a payload picks a file, a
model or code."""

from __future__ import annotations

import asyncio
import io
import time

import msgpack
import pytest
import redis

from pagedq.client import Client, SamplingParams, TLSFiles
from pagedq.client.acl import acl_rule
from pagedq.client.protocol import F_ID, F_PAYLOAD, PROTOCOL_VERSION, Keys
from pagedq.worker.config import WorkerConfig
from pagedq.worker.service.worker import Worker
from tests.chaos.servers import RedisServer
from tests.service.harness import ENGINE, running_worker

GREEDY = SamplingParams(temperature=0, max_tokens=5)


class Logs:
    """The worker's log lines, as rendered (after every processor, redaction included)."""

    def __init__(self):
        self.buffer = io.StringIO()

    def read(self) -> str:
        text, self.buffer = self.buffer.getvalue(), io.StringIO()
        from pagedq.logging import configure_logging

        configure_logging(file=self.buffer)
        return text


@pytest.fixture
def logs():
    from pagedq.logging import configure_logging

    captured = Logs()
    configure_logging(file=captured.buffer)
    yield captured
    configure_logging()


def run_worker_once(url: str, model: str, timeout: float = 60, **config) -> int:
    """A worker that should refuse to start: its exit code (it must not hang)."""
    cfg = WorkerConfig(model=model, redis_url=url, consumer_name="x", engine=dict(ENGINE),
                       **config)

    async def go():
        return await asyncio.wait_for(Worker(cfg).run(), timeout)

    return asyncio.run(go())


def one_clear_line(text: str, *needles: str) -> None:
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if "[error" in line or '"error"' in line]
    assert len(errors) == 1, text[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.fixture
def auth_server(tmp_path):
    server = RedisServer(tmp_path / "redis", ["--requirepass", "s3cret-pw"]).start(wait=False)
    time.sleep(0.3)
    yield server
    server.stop()


def test_auth_works_and_the_password_never_reaches_a_log_line(auth_server, model, reference,
                                                              logs):
    url = f"redis://:s3cret-pw@127.0.0.1:{auth_server.port}/0"
    with running_worker(url, model, "a1"), Client(url) as client:
        assert client.submit([1, 2, 3], GREEDY).result(30).token_ids == reference([1, 2, 3],
                                                                                 GREEDY)[0]
    logged = logs.read()
    assert "worker serving" in logged and "s3cret-pw" not in logged
    bad = f"redis://:wrong@127.0.0.1:{auth_server.port}/0"
    assert run_worker_once(bad, model) == 1
    text = logs.read()
    one_clear_line(text, "cannot reach Redis")
    assert "wrong" not in text


def test_acl_users_confine_each_tenant_to_its_prefix(auth_server, model, reference, logs):
    admin = redis.Redis(host="127.0.0.1", port=auth_server.port, password="s3cret-pw")
    for tenant in ("ta", "tb"):
        admin.execute_command("ACL", "SETUSER", *acl_rule(tenant, f"{tenant}-pw",
                                                          prefix=tenant).split())
    url_a = f"redis://ta:ta-pw@127.0.0.1:{auth_server.port}/0"
    url_b = f"redis://tb:tb-pw@127.0.0.1:{auth_server.port}/0"
    with running_worker(url_a, model, "a1", prefix="ta", reclaim_after=0.5), \
            Client(url_a, prefix="ta") as a, Client(url_b, prefix="tb") as b:
        handle = a.submit([4, 5], GREEDY)
        assert handle.result(30).token_ids == reference([4, 5], GREEDY)[0]
        a.handle(handle.id).cancel()  # cancel, stats: every command the SDK sends is allowed
        assert a.stats()["workers"][0]["name"] == "a1"
        time.sleep(1.5)  # a reclaim and a reap ran under the ACL too
        with pytest.raises(redis.exceptions.NoPermissionError):  # b cannot read a's output
            b.redis.xrange(Keys(prefix="ta").out(handle.id))
        with pytest.raises(redis.exceptions.NoPermissionError):  # nor enqueue into a's queue
            Client(url_b, prefix="ta").submit([1], GREEDY)
        b.submit([1], GREEDY)  # its own prefix is fine
    assert "Traceback" not in logs.read()
    admin.execute_command("ACL", "SETUSER", "narrow", "on", ">n-pw", "~pagedq:*", "-@all",
                          "+ping", "+hello", "+get", "+set")
    assert run_worker_once(f"redis://narrow:n-pw@127.0.0.1:{auth_server.port}/0", model) == 1
    one_clear_line(logs.read(), "Redis denied a command", "operations.md")
    admin.close()


def test_tls_with_a_private_ca_and_mutual_tls(tls_server, pki, model, reference, logs):
    server = tls_server(verify_clients=True)
    tls = TLSFiles(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    with running_worker(server.url, model, "t1", redis_ca=str(pki.ca),
                        redis_cert=str(pki.client_cert), redis_key=str(pki.client_key)), \
            Client(server.url, tls=tls) as client:
        assert client.submit([7, 1], GREEDY).result(30).token_ids == reference([7, 1],
                                                                              GREEDY)[0]
    query = (f"{server.url}?ssl_ca_certs={pki.ca}&ssl_certfile={pki.client_cert}"
             f"&ssl_keyfile={pki.client_key}")
    with Client(query) as client:  # the same, all in the URL
        assert client.redis.ping()
    logs.read()
    cases = [
        (server.url, dict(redis_ca=str(pki.other_ca), redis_cert=str(pki.client_cert),
                          redis_key=str(pki.client_key))),  # a CA that did not sign the server
        (server.url, dict(redis_ca=str(pki.ca))),  # no client certificate for mutual TLS
        (server.url.replace("rediss://", "redis://"), {}),  # plain text to a TLS port
    ]
    for url, config in cases:
        began = time.monotonic()
        assert run_worker_once(url, model, **config) == 1
        assert time.monotonic() - began < 30
        one_clear_line(logs.read(), "cannot reach Redis")


def test_nothing_in_a_payload_picks_a_file_a_model_or_code(redis_db, redis_client, model,
                                                           reference, tiny_text_model_dir):
    """Unknown top-level fields are ignored, unknown params refused, and chat content is data
    to the (sandboxed) template, never template code."""
    keys = Keys()
    body = {"v": PROTOCOL_VERSION, "id": "sneaky", "prompt_token_ids": [3, 4],
            "params": {"temperature": 0, "max_tokens": 5}, "model": "/etc/passwd",
            "tokenizer": "/tmp/evil", "chat_template": "{{ cycler.__init__ }}",
            "adapter": "../../x", "__class__": "os.system"}
    with running_worker(redis_db, model, "s1"), Client(redis_db) as client:
        redis_client.xadd(keys.jobs("normal"), {F_ID: "sneaky", F_PAYLOAD: msgpack.packb(body)})
        res = client.handle("sneaky").result(30)
        assert res.token_ids == reference([3, 4], SamplingParams(temperature=0, max_tokens=5))[0]
        with pytest.raises(Exception, match="unknown sampling params"):
            client.submit([1], SamplingParams.from_dict({"logits_processors": ["os.system"]}))
    from pagedq.worker.engine.intake import chat_prompt
    from pagedq.worker.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_text_model_dir)
    ids = chat_prompt(tok, tiny_text_model_dir, [{"role": "user",
                                                  "content": "{{ 7*7 }}{% print(1) %}"}])
    text = tok.decode(ids)
    assert "{{ 7*7 }}" in text and "49" not in text
