"""The gateway's TLS, both sides, for real: HTTPS to its clients (``--ssl-certfile`` and
``--ssl-keyfile``; the client trusts a private CA) and ``rediss://`` with mutual TLS to its Redis
(``--redis-ca``, ``--redis-cert``, ``--redis-key``), against the system's redis-server 7 on its
``--tls-port`` (tests/chaos/pki.py: the PKI and the server; skipped, saying why, without one)."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys

import openai
import pytest

from tests.gateway.harness import httpx, spawn_gateway
from tests.service.harness import running_worker


def test_https_to_clients_and_mutual_tls_to_redis(tls_server, pki, tiny_model, tiny_id, queue,
                                                  tmp_path):
    """A chat answered through an HTTPS gateway whose Redis wants a client certificate; a client
    trusting another CA, and plain HTTP to the HTTPS port, get no answer."""
    server = tls_server(verify_clients=True)
    files = {"redis_ca": str(pki.ca), "redis_cert": str(pki.client_cert),
             "redis_key": str(pki.client_key)}
    flags = ["--queue", queue, *(f"--{k.replace('_', '-')}={v}" for k, v in files.items()),
             "--ssl-certfile", str(pki.server_cert), "--ssl-keyfile", str(pki.server_key)]
    with running_worker(server.url, tiny_model, f"{queue}-w", queue=queue, **files):
        proc, base = spawn_gateway(server.url, tmp_path / "gateway.log", *flags, ca=str(pki.ca))
        try:
            assert base.startswith("https://")
            trusting = httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca)))
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                   http_client=trusting)
            answer = client.chat.completions.create(
                model=tiny_id, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                temperature=0, extra_body={"ignore_eos": True})
            assert answer.usage.completion_tokens == 4 and answer.choices[0].message.content
            stranger = httpx.Client(verify=ssl.create_default_context(cafile=str(pki.other_ca)))
            with pytest.raises(openai.APIConnectionError):
                openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                              http_client=stranger).models.list()
            with pytest.raises(httpx.HTTPError):
                httpx.get(base.replace("https://", "http://") + "/health", timeout=10)
            trusting.close()
            stranger.close()
        finally:
            proc.terminate()
            proc.wait(60)
    log = (tmp_path / "gateway.log").read_text()
    assert proc.returncode == -signal.SIGTERM and "Traceback" not in log, log[-2000:]


@pytest.mark.parametrize("case", ["certificate alone", "key alone", "the wrong key"])
def test_https_flags_that_cannot_serve_are_a_usage_error(pki, case):
    """Checked before anything starts: exit 2 and one line saying what to give."""
    cert, key = str(pki.server_cert), str(pki.server_key)
    given = {"certificate alone": ["--ssl-certfile", cert],
             "key alone": ["--ssl-keyfile", key],
             "the wrong key": ["--ssl-certfile", cert, "--ssl-keyfile", str(pki.client_key)]}
    done = subprocess.run([sys.executable, "-m", "pagedq.worker.cli", "serve", "--redis-url",
                           "redis://127.0.0.1:9/0", *given[case]], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--ssl-certfile" in done.stderr and "--ssl-keyfile" in done.stderr


def test_sigterm_closes_an_idle_https_keep_alive_connection_at_once(pki, redis_url, queue,
                                                                    tmp_path):
    """A client that keeps its HTTPS connection open between requests (every pooling SDK does)
    must not hold the gateway's shutdown for the graceful limit: idle, it has nothing to lose.
    uvicorn closes it, but a TLS close waits for the peer's close_notify, which an idle client
    never sends; the gateway shuts it at once instead of logging the limit's expiry."""
    flags = ["--queue", queue, "--ssl-certfile", str(pki.server_cert),
             "--ssl-keyfile", str(pki.server_key)]
    log_path = tmp_path / "gateway.log"
    proc, base = spawn_gateway(redis_url, log_path, *flags, "--log-level", "INFO",
                               ca=str(pki.ca))
    try:
        client = httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca)))
        assert client.get(base + "/health").status_code == 200  # the connection stays open
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    log = log_path.read_text()
    assert proc.returncode == -signal.SIGTERM and "Traceback" not in log, log[-2000:]
    assert "timeout graceful shutdown exceeded" not in log, log[-2000:]


def test_sigterm_lets_an_https_stream_in_flight_finish(pki, redis_url, queue, tiny_model,
                                                        tiny_id, tmp_path):
    """The other side of the idle close: a stream being answered when SIGTERM comes keeps
    uvicorn's graceful limit and ends with all its tokens and ``[DONE]``, while an idle
    keep-alive client beside it does not hold the stop."""
    flags = ["--queue", queue, "--ssl-certfile", str(pki.server_cert),
             "--ssl-keyfile", str(pki.server_key)]
    verify = ssl.create_default_context(cafile=str(pki.ca))
    body = {"model": tiny_id, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with running_worker(redis_url, tiny_model, f"{queue}-w", queue=queue):
        proc, base = spawn_gateway(redis_url, tmp_path / "gateway.log", *flags, ca=str(pki.ca))
        try:
            idle = httpx.Client(verify=verify)
            assert idle.get(base + "/health").status_code == 200
            with httpx.Client(verify=verify, timeout=60) as streaming, \
                    streaming.stream("POST", base + "/v1/chat/completions", json=body) as resp:
                lines = resp.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
            proc.wait(60)
            idle.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)
    assert first and rest[-1] == "data: [DONE]"
    usage = [u for u in (json.loads(line[6:]).get("usage") for line in rest[:-1]) if u]
    assert usage and usage[-1]["completion_tokens"] == 24
    log = (tmp_path / "gateway.log").read_text()
    assert proc.returncode == -signal.SIGTERM and "Traceback" not in log, log[-2000:]
    assert "timeout graceful shutdown exceeded" not in log, log[-2000:]
