"""Errors and limits, as the official openai client sees them: 401, 404, 400, 413, 429, 503."""

from __future__ import annotations

import json

import openai
import pytest

from pagedq.client import Client, SamplingParams
from pagedq.params import SamplingParams as EngineParams
from tests.gateway.harness import serve

HELLO = [{"role": "user", "content": "Hello"}]


def test_bearer_key_is_checked(redis_url, queue, tiny_worker, tiny_id):
    with serve(redis_url, queue=queue, api_keys=("k1", "k2")) as gw:
        with pytest.raises(openai.AuthenticationError) as err:
            gw.openai("wrong").models.list()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            gw.openai("none").chat.completions.create(model=tiny_id, messages=HELLO)
        assert [m.id for m in gw.openai("k2").models.list()] == [tiny_id]
        with gw.http() as http:
            assert http.get("/health").status_code == 200  # probes need no key


def test_unknown_model_route_and_ids_are_404(redis_url, queue, tiny_worker, tiny_id):
    with serve(redis_url, queue=queue) as gw:
        client = gw.openai()
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model="gpt-4o", messages=HELLO)
        assert err.value.code == "model_not_found" and tiny_id in err.value.message
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve("file-nope")
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_nope")
        with gw.http() as http:
            resp = http.get("/v1/requests/chatcmpl-nope/stream")
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "stream_not_found"
            assert http.get("/v1/nothing").json()["error"]["code"] == "not_found"


def test_invalid_params_are_400_with_the_engines_message(redis_url, queue, tiny_worker, tiny_id):
    with serve(redis_url, queue=queue) as gw:
        client = gw.openai()
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=tiny_id, messages=HELLO, temperature=-1)
        with pytest.raises(Exception) as engine:
            EngineParams(temperature=-1.0)
        assert err.value.body["message"] == str(engine.value)
        assert err.value.body["param"] == "temperature"
        with pytest.raises(openai.BadRequestError):  # a pydantic type error is a 400 too
            client.chat.completions.create(model=tiny_id, messages="hi")
        with gw.http() as http:
            assert 'route="/v1/chat/completions",status="400"' in http.get("/metrics").text
        long = " ".join(["Paris"] * 400)  # past the worker's max_model_len: its own refusal
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model=tiny_id, prompt=long, max_tokens=4,
                                          stream=stream)
            assert err.value.code == "prompt_too_long"


def test_body_over_the_limit_is_413(redis_url, queue, tiny_worker, tiny_id):
    with serve(redis_url, queue=queue, max_body_bytes=2000) as gw:
        with pytest.raises(openai.APIStatusError) as err:
            gw.openai().chat.completions.create(
                model=tiny_id, messages=[{"role": "user", "content": "x" * 5000}])
        assert err.value.status_code == 413 and err.value.code == "request_too_large"
        with gw.http() as http:  # chunked (no Content-Length): counted as it arrives
            resp = http.post("/v1/chat/completions", content=iter([b"{" + b" " * 1500] * 3),
                             headers={"content-type": "application/json"})
            assert resp.status_code == 413


def test_deep_queue_is_429_with_retry_after(redis_url, queue, tiny_worker, tiny_id):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with serve(redis_url, queue=queue, max_queue_depth=1) as gw, \
            Client(redis_url, queue) as sdk:
        # far more than fit at once: 4 run at a time, so 48 take the tiny worker 12 waves of
        # 200 steps (8 were drained before the request on a fast CPU, an Intel Xeon with AMX)
        handles = [sdk.submit([3, 4, 5 + i], long) for i in range(48)]
        try:
            with pytest.raises(openai.RateLimitError) as err:
                gw.openai().chat.completions.create(model=tiny_id, messages=HELLO)
            assert err.value.response.headers["retry-after"] == "1"
        finally:
            for h in handles:
                h.cancel()


def test_no_live_worker_is_503(redis_url):
    """Issue 25, Low-6: while a worker loads (or none runs) a request is told to retry: 503
    with Retry-After, saying one may be starting, not a bare "no worker"."""
    with serve(redis_url, queue="gw-nobody") as gw:
        with pytest.raises(openai.InternalServerError) as err:
            gw.openai().chat.completions.create(model="any", messages=HELLO)
        assert err.value.status_code == 503 and err.value.code == "no_worker"
        assert err.value.response.headers["retry-after"] == "5"
        assert "starting" in err.value.message and "retry" in err.value.message


def test_the_gateway_logs_ready_once_a_worker_serves(redis_url, tiny_model, tiny_id):
    """Issue 25, Low-6: `serve`'s own worker loads after the gateway is up. The gateway logs
    "the gateway is ready" once that worker serves, with no request to prompt it, and not
    before (while the worker loads, requests get the 503 above)."""
    from structlog.testing import capture_logs

    from tests.gateway.harness import wait_until
    from tests.service.harness import running_worker

    def ready(logs: list[dict]) -> list[dict]:
        return [e for e in logs if e["event"] == "workers serving: the gateway is ready"]

    with capture_logs() as logs, serve(redis_url, queue="gw-ready") as gw, gw.http() as http:
        assert http.get("/health").json()["workers"] == 0  # the fleet was read: nobody yet
        assert ready(logs) == []
        with running_worker(redis_url, tiny_model, "gw-ready-w", queue="gw-ready"):
            wait_until(lambda: ready(logs), 60, 'the "gateway is ready" line')
            assert [(e["log_level"], e["workers"], e["models"]) for e in ready(logs)] == [
                ("info", 1, [tiny_id])]


def test_an_unexpected_error_echoes_nothing_and_redis_refusals_are_503():
    """Issue 25, Low-1: a gateway bug's 500 quotes no exception text (paths, Redis commands);
    Redis's OOM, however redis-py words it (inside a Lua script too), is 503 storage_full."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import OutOfMemoryError, ResponseError

    from pagedq.gateway.api_errors import unexpected

    bug = unexpected(KeyError("/srv/pagedq/files/secret.json"))
    assert (bug.status, bug.code) == (500, "internal")
    assert "secret" not in json.dumps(bug.body()) and "internal error" in bug.message
    for oom in (OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
                ResponseError("OOM command not allowed when used memory > 'maxmemory'."),
                ResponseError("Error running script (call to f_91f1): @user_script:11: "
                              "@user_script: 11: -OOM command not allowed when used memory > "
                              "'maxmemory'.")):
        err = unexpected(oom)
        assert (err.status, err.code) == (503, "storage_full"), oom
        assert "script" not in err.message and err.headers["Retry-After"]
    down = unexpected(RedisConnectionError("Error 111 connecting to 10.0.0.5:6379."))
    assert (down.status, down.code) == (503, "redis_unavailable") and "10.0.0.5" not in down.message


def test_an_expected_503_logs_one_line_and_a_500_its_traceback():
    """Issue 25: at a full Redis every request once logged a whole traceback. An expected 503
    (Redis full or down: the client retries) is one warning line now, naming its code with the
    URL's password masked; a gateway bug's 500 still logs its traceback."""
    import asyncio

    import httpx
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import OutOfMemoryError
    from structlog.testing import capture_logs

    from pagedq.gateway.app import GatewayMiddleware
    from pagedq.gateway.http_metrics import GatewayMetrics
    from pagedq.worker.config import GatewayConfig

    metrics = GatewayMetrics()

    async def answer(exc: Exception) -> tuple[int, list[dict]]:
        async def route(scope, receive, send):
            raise exc

        app = GatewayMiddleware(route, GatewayConfig(api_keys=()), metrics)
        with capture_logs() as logs:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://localhost") as http:
                resp = await http.post("/v1/chat/completions", json={})
        return resp.status_code, logs

    for exc, code in ((OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
                       "storage_full"),
                      (RedisConnectionError("Error connecting to redis://gw:hunter2@db:6379"),
                       "redis_unavailable")):
        status, logs = asyncio.run(answer(exc))
        assert status == 503
        assert len(logs) == 1 and logs[0]["log_level"] == "warning", logs
        assert logs[0]["code"] == code and "exc_info" not in logs[0], logs
        assert "hunter2" not in json.dumps(logs, default=str)
    status, logs = asyncio.run(answer(KeyError("a gateway bug")))
    assert status == 500
    assert len(logs) == 1 and logs[0]["log_level"] == "error" and logs[0]["exc_info"], logs
