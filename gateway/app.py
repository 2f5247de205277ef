"""The FastAPI app: shared state, the auth/limits/metrics middleware, errors, small routes.

Routes live with their nouns: completions.py (chat, completions, stream resume) and
batch_api.py (files, batches). Everything a route needs hangs off ``Gateway``
(``request.app.state.gateway``), built in the app's lifespan so it binds to uvicorn's loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import time
from collections.abc import Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aredis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedq.client import AsyncClient
from pagedq.gateway.api_errors import APIError, unexpected
from pagedq.gateway.batch_store import BatchStore
from pagedq.gateway.batches import BatchDriver
from pagedq.gateway.files import DirFileStore, FileStore, RedisFileStore
from pagedq.gateway.fleet import Fleet
from pagedq.gateway.http_metrics import CONTENT_TYPE, GatewayMetrics
from pagedq.gateway.sse import Readers
from pagedq.gateway.tokens import TokenTexts
from pagedq.logging import get_logger
from pagedq.worker.config import GatewayConfig

log = get_logger("pagedq.gateway")

MULTIPART_SLACK = 64 << 10  # form boundaries and headers around an uploaded file


@dataclass
class Gateway:
    """Everything the routes share; one per app."""

    config: GatewayConfig
    r: aredis.Redis
    client: AsyncClient
    fleet: Fleet
    readers: Readers
    files: FileStore
    batches: BatchStore
    driver: BatchDriver
    tokens: TokenTexts
    metrics: GatewayMetrics
    tasks: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a background coroutine, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @classmethod
    def build(cls, config: GatewayConfig, redis_url: str, metrics: GatewayMetrics) -> Gateway:
        pool = aredis.BlockingConnectionPool.from_url(  # wait for a connection, don't fail
            redis_url, max_connections=config.redis_max_connections,
            timeout=config.redis_pool_timeout, health_check_interval=30, socket_keepalive=True,
            **(config.tls.kwargs() if config.tls else {}))
        r = aredis.Redis.from_pool(pool)  # closes the pool with the client
        client = AsyncClient(queue=config.queue, prefix=config.prefix, ttl=config.ttl,
                             connection=r)
        fleet = Fleet(client, config.fleet_cache)
        files: FileStore = (DirFileStore(config.files_dir, config.files_ttl) if config.files_dir
                            else RedisFileStore(r, config.prefix, config.files_ttl))
        tokens = TokenTexts()
        driver = BatchDriver(r, client, files, fleet, tokens, config, metrics)
        return cls(config, r, client, fleet, Readers(r, client.keys, config.ttl), files,
                   driver.store, driver, tokens, metrics)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.r.aclose()


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


@dataclass(frozen=True)
class Tenant:
    """Who made a request: ``owner`` is its API key's fingerprint ("" on an open gateway);
    files, batches and streams carry their owner, and only it (or an admin key) sees them."""

    owner: str = ""
    admin: bool = False

    def sees(self, owner: str) -> bool:
        return self.admin or hmac.compare_digest(owner, self.owner)


OPEN = Tenant("", admin=True)  # no keys configured: one trust domain, as before
TENANT = "pagedq.tenant"  # the scope key the middleware sets


def key_owner(key: bytes) -> str:
    """A key's tenant id: a fingerprint, so Redis never holds the key itself."""
    return "key-" + hashlib.sha256(key).hexdigest()[:24]


def tenant(request: Request) -> Tenant:
    return request.scope.get(TENANT, OPEN)


def create_app(config: GatewayConfig, redis_url: str) -> FastAPI:
    """The ASGI app for ``config`` against the Redis at ``redis_url``."""
    from pagedq.gateway import batch_api, completions, tokenize

    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw = Gateway.build(config, redis_url, metrics)
        app.state.gateway = gw
        gw.spawn(gw.driver.run())
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
            if err.status >= 500:
                log.exception("request failed", path=scope["path"])
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


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over the gateway's limit of {limit} bytes "
                    "(--max-body-bytes / --max-file-bytes)", "invalid_request_error",
                    "request_too_large")


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
