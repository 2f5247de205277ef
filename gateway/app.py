"""The FastAPI app: the auth/limits/metrics middleware, errors, small routes.

Routes live with their nouns: completions.py (chat, completions, stream resume), batch_api.py
(files, batches) and tokenize.py. Everything a route needs hangs off ``Gateway`` in state.py
(``request.app.state.gateway``), which the routes import; this module imports the routes, and
nothing imports it but the commands that serve it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedq.gateway import batch_api, completions, tokenize
from pagedq.gateway.api_errors import APIError, too_large, unexpected
from pagedq.gateway.http_metrics import CONTENT_TYPE, GatewayMetrics
from pagedq.gateway.state import TENANT, Gateway, Tenant, gateway, key_owner
from pagedq.logging import get_logger
from pagedq.redact import redact_url
from pagedq.worker.config import GatewayConfig

log = get_logger("pagedq.gateway")

MULTIPART_SLACK = 64 << 10  # form boundaries and headers around an uploaded file


def create_app(config: GatewayConfig, redis_url: str) -> FastAPI:
    """The ASGI app for ``config`` against the Redis at ``redis_url``."""
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw = Gateway.build(config, redis_url, metrics)
        app.state.gateway = gw
        gw.spawn(gw.driver.run())
        gw.spawn(gw.fleet.watch())  # logs "the gateway is ready" once a worker serves
        try:
            yield
        finally:
            await gw.close()

    app = FastAPI(title="pagedq", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.include_router(completions.router)
    app.include_router(batch_api.router)
    app.include_router(tokenize.router)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics_route, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_middleware(GatewayMiddleware, config=config, metrics=metrics)
    return app


# -- middleware ---------------------------------------------------------------------------------


class BodyTooLarge(Exception):
    pass


class GatewayMiddleware:
    """Bearer auth on /v1, the body limit (413), per-route request metrics and the answer to
    what no route foresaw (``unexpected``: a 400 for bad input, else a 500 naming nothing), in
    plain ASGI (no BaseHTTPMiddleware: it would buffer streams and hide client disconnects)."""

    def __init__(self, app: ASGIApp, config: GatewayConfig, metrics: GatewayMetrics):
        self.app = app
        self.tenants = [(k.encode(), Tenant(key_owner(k.encode()))) for k in config.api_keys]
        self.tenants += [(k.encode(), Tenant(key_owner(k.encode()), admin=True))
                         for k in config.admin_keys]
        self.hosts = HostCheck(config.host, config.allowed_hosts)
        self.max_body = config.max_body_bytes
        self.max_file = config.max_file_bytes + MULTIPART_SLACK
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began = time.perf_counter()
        state = {"code": 500, "started": False, "over": False}
        limit = self.max_file if scope["path"].startswith("/v1/files") else self.max_body

        async def send_wrapper(message: Message) -> None:
            if state["over"]:  # the body overflowed: whatever the app says becomes a 413
                if not state["started"]:
                    state["started"] = True
                    await _send_error(send_counted, too_large(limit))
                return
            await send_counted(message)

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                state.update(code=message["status"], started=True)
            await send(message)

        async def receive_limited() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["seen"] = state.get("seen", 0) + len(message.get("body", b""))
                if state["seen"] > limit:
                    state["over"] = True
                    raise BodyTooLarge()
            return message

        try:
            refusal = self._refusal(scope, limit)
            if refusal is not None:
                await _send_error(send_counted, refusal)
                return
            await self.app(scope, receive_limited, send_wrapper)
        except BodyTooLarge:
            await send_wrapper({"type": "http.response.start"})
        except ClientDisconnect:  # gone mid-body: no error of ours, nobody to answer
            log.info("client disconnected mid-request", path=scope["path"])
            state["code"] = 499
        except Exception as exc:  # here, not in an app handler: Starlette re-raises those
            err = unexpected(exc)
            log_failure(err, exc, scope["path"])
            if state["started"]:
                raise
            await _send_error(send_counted, err)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(label, str(state["code"])).inc()
            self.metrics.latency.labels(label).observe(time.perf_counter() - began)

    def _refusal(self, scope: Scope, limit: int) -> APIError | None:
        headers = dict(scope["headers"])
        refused = self.hosts.refusal(headers)
        if refused is not None:
            return refused
        if self.tenants and (scope["path"].startswith("/v1/") or scope["path"] == "/openapi.json"):
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            matched = [t for key, t in self.tenants if hmac.compare_digest(token, key)]
            if not matched:
                return APIError(401, "Incorrect API key provided: send the gateway's key as "
                                "'Authorization: Bearer KEY'", "invalid_request_error",
                                "invalid_api_key")
            scope[TENANT] = matched[-1]  # an admin key listed as both is an admin
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return too_large(limit)
        return None


def log_failure(err: APIError, exc: Exception, path: str) -> None:
    """A 500 (a gateway bug) is logged with its traceback. An expected 503 (Redis full or
    down: the client is told to retry) is one warning line: at a full Redis every request
    gets one, and a traceback each would bury the log. A 4xx is the client's, not logged."""
    if err.status == 503:
        log.warning("request refused: retry later", path=path, code=err.code,
                    error=redact_url(f"{type(exc).__name__}: {exc}")[:200])
    elif err.status >= 500:
        log.exception("request failed", path=path)


class HostCheck:
    """DNS rebinding and cross-site requests: the Host header must be an IP address, a loopback
    name, the bound address or an ``--allowed-hosts`` entry (a rebinding attack needs a name of
    its own), and an Origin, when a browser sends one, must pass the same test."""

    LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})

    def __init__(self, bound: str, allowed: list[str]):
        self.any = "*" in allowed
        self.names = self.LOOPBACK | {host_name(h) for h in [*allowed, bound]}

    def allows(self, host: str) -> bool:
        name = host_name(host)
        if self.any or not name or name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False

    def refusal(self, headers: dict[bytes, bytes]) -> APIError | None:
        if not self.allows(headers.get(b"host", b"").decode("latin-1")):
            return APIError(421, "this gateway does not answer to that Host: add it with "
                            "--allowed-hosts", "invalid_request_error", "host_not_allowed")
        origin = headers.get(b"origin", b"").decode("latin-1").strip()
        if origin and (origin == "null" or not self.allows(
                origin.split("://", 1)[-1].split("/", 1)[0])):
            return APIError(403, "cross-origin requests from that Origin are refused: add its "
                            "host with --allowed-hosts", "invalid_request_error",
                            "origin_not_allowed")
        return None


def host_name(host: str) -> str:
    """``name:port``, ``[v6]:port`` or a bare name/address -> the lowercased name."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.split(":", 1)[0] if host.count(":") == 1 else host


class ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: a message quoting a client's text (a lone surrogate
    included) always renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(err: APIError) -> Response:
    return ErrorResponse(err.body(), err.status, headers=err.headers)


async def _send_error(send: Send, err: APIError) -> None:
    response = error_response(err)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


# -- error handlers -----------------------------------------------------------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg", exc))
    return error_response(APIError(400, message, param=param))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = APIError(exc.status_code, str(exc.detail), "invalid_request_error", code)
    return error_response(err)


# -- small routes -------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    """200 while Redis answers (with the live worker count), 503 otherwise."""
    gw = gateway(request)
    try:
        view = await gw.fleet.view()
    except Exception as exc:
        return JSONResponse({"status": "unavailable", "error": str(exc)}, 503)
    return JSONResponse({"status": "ok", "workers": view.alive, "models": sorted(view.models)})


async def metrics_route(request: Request) -> Response:
    return Response(gateway(request).metrics.render(), media_type=CONTENT_TYPE)


async def list_models(request: Request) -> Response:
    view = await gateway(request).fleet.view()
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "pagedq", "root": name}
            for name in sorted(view.models)]  # never the worker's path on its disk
    return JSONResponse({"object": "list", "data": data})
