"""Slow clients against a real `pagedq serve` process, over raw sockets (issue 25, Low 3):
headers dribbled a byte at a time (slowloris) or a body that stops arriving hold a connection
only until --timeout-header / --timeout-body; an ordinary client is served meanwhile."""

from __future__ import annotations

import select
import socket
import time

import pytest

from tests.gateway.harness import httpx, spawn_gateway, wait_until

GIVE_UP_S = 60.0  # far past the 1 s timeouts: only a gateway that never closes reaches it


def closed_by_server(sock: socket.socket, dribble: bytes = b"") -> bool:
    """Whether the gateway closes ``sock`` (EOF or reset) before GIVE_UP_S, sending one byte of
    ``dribble`` every 0.2 s meanwhile, as a slowloris client keeps a connection busy."""
    end = time.monotonic() + GIVE_UP_S
    sent = 0
    while time.monotonic() < end:
        readable, _, _ = select.select([sock], [], [], 0.2)
        try:
            if readable and sock.recv(4096) == b"":
                return True
            if sent < len(dribble):
                sock.sendall(dribble[sent:sent + 1])
                sent += 1
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


@pytest.fixture(scope="module")
def gateway(redis_url, tmp_path_factory):
    log = tmp_path_factory.mktemp("slow") / "gateway.log"
    proc, base = spawn_gateway(redis_url, log, "--queue", "slow", "--timeout-header", "1",
                               "--timeout-body", "1", "--timeout-keep-alive", "30")
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=GIVE_UP_S)


def read_response(sock: socket.socket) -> bytes:
    """One whole answer (head and Content-Length body), leaving the connection open."""
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(4096)
    head, body = reply.split(b"\r\n\r\n", 1)
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    while len(body) < length:
        body += sock.recv(4096)
    return reply


def test_headers_sent_a_byte_at_a_time_are_cut_off(gateway):
    headers = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 4000
    with connect(gateway) as sock:
        assert closed_by_server(sock, dribble=headers)


def test_a_silent_connection_is_cut_off(gateway):
    with connect(gateway) as sock:
        assert closed_by_server(sock)


def test_a_body_that_stops_arriving_is_cut_off(gateway):
    with connect(gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"mod")
        assert closed_by_server(sock)
    metrics = httpx.get(gateway + "/metrics", timeout=30).text
    assert 'status="500"' not in metrics


def test_a_kept_alive_connection_must_send_its_next_headers_in_time(gateway):
    """After one answered request the connection stays open (keep-alive 30 s here), but a
    second request whose headers dribble is still cut off at --timeout-header."""
    with connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert closed_by_server(sock, dribble=b"GET /health HTTP/1.1\r\n" + b"X: y\r\n" * 500)


def test_ordinary_clients_are_served_while_slow_ones_hold_connections(gateway):
    slow = [connect(gateway) for _ in range(20)]
    try:
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-")
        assert httpx.get(gateway + "/health", timeout=30).status_code == 200
        assert all(closed_by_server(sock) for sock in slow)
    finally:
        for sock in slow:
            sock.close()


def test_limit_concurrency_answers_503_past_it_and_serves_again_below(redis_url, tmp_path):
    """--limit-concurrency reaches uvicorn: with that many connections open (here: silent ones,
    within --timeout-header), the next request is refused with a 503 instead of queueing on an
    overloaded gateway; once they go, requests are served again."""
    proc, base = spawn_gateway(redis_url, tmp_path / "gateway.log", "--queue", "slow-limit",
                               "--limit-concurrency", "3", "--timeout-header", "30")
    try:
        held = [connect(base) for _ in range(3)]
        try:
            for sock in held:  # each is accepted and counted before the next request comes
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            wait_until(lambda: httpx.get(base + "/health", timeout=30).status_code == 503, 30,
                       "a 503 past --limit-concurrency")
        finally:
            for sock in held:
                sock.close()
        wait_until(lambda: httpx.get(base + "/health", timeout=30).status_code == 200, 30,
                   "requests served again")
    finally:
        proc.terminate()
        proc.wait(30)
