"""What a Redis user needs to run pagedq, and nothing more: the ACL rule for one tenant.

Redis access is pagedq's trust boundary: anyone who can run these commands on a prefix's keys
can read its prompts and tokens, submit and cancel its jobs. A tenant gets a key prefix of its
own (``Client(prefix=...)``, ``pagedq worker --prefix ...``) and a Redis user confined to it:

    ACL SETUSER <user> on ><password> resetkeys ~<prefix>:* resetchannels -@all +<command> ...

``COMMANDS`` is every command a worker or client sends, including those its Lua scripts call
(Redis checks those against the user too). Every one of them exists in Redis 6.2 through 8 and
in Valkey; the chaos suite checks that nothing else is sent. ``GATEWAY_COMMANDS`` adds what
``pagedq serve`` sends for its files, batches and streams (tests/gateway/test_hostile.py runs
a gateway and a worker under that rule on a real Redis). Neither list holds an admin or
dangerous command (``CONFIG``, ``ACL``, ``KEYS``, ``FLUSHALL``, ...).
"""

from __future__ import annotations

COMMANDS: tuple[str, ...] = (
    # connection set-up and health (the cluster probe asks HELLO)
    "ping", "hello",
    # scripts: the protocol's writes (client/scripts.py)
    "evalsha", "script|load",
    # job streams and output streams
    "xadd", "xread", "xreadgroup", "xack", "xdel", "xrange", "xrevrange", "xlen", "xpending",
    "xclaim", "xautoclaim", "xinfo|consumers", "xgroup|create", "xgroup|delconsumer",
    # request state, checkpoints, stats, names, the cancel hint, the wake-up streams
    "hset", "hget", "hmget", "hgetall", "hincrby", "hexists", "del", "exists", "expire",
    "pexpire", "zadd", "zrem", "zrange", "zremrangebyscore", "set", "get", "incr", "incrby",
    "type",
    "multi", "exec",
)


GATEWAY_COMMANDS: tuple[str, ...] = (
    "hsetnx", "hdel", "hlen",  # batch lines in flight, their outputs exactly once
    "sadd", "srem", "smembers", "zrevrange",  # the batches to drive, listings
    "getrange",  # a file's bytes, streamed out in chunks
    "append",  # an upload's bytes, written in pieces as they arrive
)


def acl_rule(user: str, password: str, prefix: str = "pagedq", gateway: bool = False) -> str:
    """The ``ACL SETUSER`` arguments confining ``user`` to the queues under ``prefix``;
    ``gateway``: also what ``pagedq serve`` needs."""
    allowed = " ".join(f"+{c}" for c in COMMANDS + (GATEWAY_COMMANDS if gateway else ()))
    return f"{user} on >{password} resetkeys ~{prefix}:* resetchannels -@all {allowed}"
