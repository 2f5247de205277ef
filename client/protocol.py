"""The wire protocol between clients and workers: key names, ids, msgpack payloads, versions.

Everything another language needs to enqueue a job or read its output is defined here, in
scripts.py (the Lua scripts) and in queue.py (consumer group, depth); docs/queue.md is the
reference. Payloads are msgpack maps carrying ``"v": PROTOCOL_VERSION``; nothing is ever
pickled, so a hostile payload can at worst be rejected.

Key schema (``P`` = prefix, default ``pagedq``; ``Q`` = queue name; ``ID`` = request id;
the braces around ``Q`` are literal)::

    P:{Q}:jobs:high, P:{Q}:jobs:normal, P:{Q}:jobs:low  job streams, one per priority level,
                                                        consumer group "workers"
    P:{Q}:dead                                          dead-letter stream
    P:{Q}:stats                                         hash: queue depth per level
    P:{Q}:workers                                       zset: worker name -> last heartbeat
    P:{Q}:worker:NAME                                   hash: that worker's checkpoint (TTL)
    P:{Q}:lock:NAME                                     string: NAME is taken by a live worker
    P:{Q}:cancels                                       counter: bumped after each cancel of a
                                                        running job, so workers re-check at once
    P:{Q}:wake:CLIENT                                   stream: wakes one client's readers
    P:{Q}:req:ID:out                                    the request's output stream (TTL)
    P:{Q}:req:ID:state                                  hash: epoch, owner, seq, done... (TTL)

``{Q}`` is a Redis Cluster hash tag: every key of a queue lives in one slot, so every script
touches a job's stream entry and its request keys atomically, and one XREAD reads any number
of a queue's output streams. A cluster spreads queues (and tenants) over its masters.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack

from pagedq.errors import InvalidParamsError
from pagedq.logprobs import PromptLogprobs
from pagedq.params import SamplingParams
from pagedq.tools.prompt import check_template_kwargs

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "pagedq"
DEFAULT_QUEUE = "default"
GROUP = "workers"
DEFAULT_TTL_S = 3600  # seconds a request's output stream and state live after their last write

# Priority levels, read highest first. A request's integer priority maps to a level by sign;
# the integer itself also orders the engine's waiting queue (higher runs first).
LEVELS: tuple[str, ...] = ("high", "normal", "low")
MAX_ABS_PRIORITY = 1_000_000

# Stream entry fields.
F_ID = b"id"  # job entry: the request id, repeated outside the payload so a worker can
F_PAYLOAD = b"p"  # address an error event even when the payload does not decode
F_SEQ = b"seq"  # output entry: 1, 2, 3, ... per request, whichever worker wrote it
F_EVENT = b"e"  # output entry: the msgpack event

# Event types. Exactly one terminal event ends every output stream.
TOKENS = "tokens"
FINISHED = "finished"
ERROR = "error"
CANCELLED = "cancelled"
TERMINAL = frozenset({FINISHED, ERROR, CANCELLED})

# Error codes carried by error events.
E_BAD_PAYLOAD = "bad_payload"
E_UNSUPPORTED_VERSION = "unsupported_version"
E_INVALID_PARAMS = "invalid_params"
E_INVALID_REQUEST = "invalid_request"
E_TOO_LONG = "prompt_too_long"
E_DEAD_LETTER = "dead_letter"
E_DUPLICATE_ID = "duplicate_id"
E_INTERNAL = "internal"

_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")


class ProtocolError(ValueError):
    """A payload is not a valid protocol message.

    ``code`` is the error code for the error event; ``request_id`` is set when the message
    named a usable id, so the worker can tell that request's client what went wrong.
    """

    def __init__(self, message: str, code: str = E_BAD_PAYLOAD, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keys:
    """Every Redis key name the protocol uses, for one prefix and queue.

    Each key starts ``P:{Q}:``: the prefix, then the queue name as a Redis Cluster hash tag,
    so all of a queue's keys share one slot (a cluster node) and ACL key patterns like
    ``~P:*`` cover a tenant's queues.
    """

    queue: str = DEFAULT_QUEUE
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        for what, value in (("queue name", self.queue), ("key prefix", self.prefix)):
            if not isinstance(value, str) or not _NAME_RE.match(value):
                raise ValueError(f"{what} {value!r} is invalid: use 1-64 characters of "
                                 "[A-Za-z0-9._:-] (it becomes part of every key name)")

    @property
    def base(self) -> str:
        """What every key of this queue starts with."""
        return f"{self.prefix}:{{{self.queue}}}"

    def jobs(self, level: str) -> str:
        return f"{self.base}:jobs:{level}"

    def all_jobs(self) -> list[str]:
        """Job streams in read order (highest priority first)."""
        return [self.jobs(level) for level in LEVELS]

    @property
    def dead(self) -> str:
        return f"{self.base}:dead"

    @property
    def stats(self) -> str:
        return f"{self.base}:stats"

    @property
    def workers(self) -> str:
        return f"{self.base}:workers"

    def worker(self, name: str) -> str:
        return f"{self.base}:worker:{name}"

    @property
    def starting(self) -> str:
        """Workers still loading their model: zset ``host:pid`` -> when the claim expires."""
        return f"{self.base}:starting"

    def lock(self, name: str) -> str:
        """Held (with the checkpoint TTL) by the live worker using consumer name ``name``."""
        return f"{self.base}:lock:{name}"

    @property
    def cancels(self) -> str:
        return f"{self.base}:cancels"

    def wake(self, client_id: str) -> str:
        """A client's wake-up stream: its stream readers block on it too (client/reader.py)."""
        return f"{self.base}:wake:{client_id}"

    def out(self, request_id: str) -> str:
        return f"{self.base}:req:{request_id}:out"

    def state(self, request_id: str) -> str:
        return f"{self.base}:req:{request_id}:state"


def priority_level(priority: int) -> str:
    """The stream level of an integer priority: > 0 high, 0 normal, < 0 low."""
    return LEVELS[0] if priority > 0 else LEVELS[1] if priority == 0 else LEVELS[2]


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_request_id(request_id: Any) -> str:
    """Request ids become part of key names: 1-128 chars of ``[A-Za-z0-9._:-]``."""
    if not isinstance(request_id, str) or not _ID_RE.match(request_id):
        raise ProtocolError(
            f"request id {request_id!r} is invalid: use 1-128 characters of [A-Za-z0-9._:-]",
            E_INVALID_REQUEST,
        )
    return request_id


def implicit_seed(request_id: str) -> int:
    """The seed a worker gives a sampled request that brings none: a function of its id.

    Every job thus samples reproducibly, so any owner resumes it exactly where the last one
    stopped, and a stream rewritten after Redis lost writes repeats what readers already saw.
    Two requests still differ (their ids do), and resubmitting an id returns its one result.
    """
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


def engine_id(request_id: str, epoch: int) -> str:
    """The id a worker gives a job in its engine: ``<request id>#<epoch>``.

    A later owner epoch of the same request is another engine request, so a stale output never
    reaches it. Request ids never contain ``#``, so the split is unambiguous.
    """
    return f"{request_id}#{epoch}"


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


@dataclass
class Request:
    """One generation job as it travels on the job stream.

    Exactly one of ``prompt`` (text), ``messages`` (chat, rendered by the worker's chat
    template) and ``prompt_token_ids`` is set. ``chat_template_kwargs``: extra variables for
    that template (vLLM's field, e.g. ``{"enable_thinking": False}``); only with messages.
    """

    id: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    deadline: float | None = None  # unix seconds; past it the job is not started / is stopped
    priority: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def level(self) -> str:
        return priority_level(self.priority)


def build_request(
    prompt: Any,
    params: SamplingParams | None = None,
    *,
    request_id: str | None = None,
    deadline: float | None = None,
    priority: int = 0,
    metadata: dict[str, Any] | None = None,
    limits: Limits | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Request:
    """Classify ``prompt`` (str | chat messages | token ids) into a validated Request that
    fits ``limits`` (default: ``DEFAULT_LIMITS``, what a worker accepts unless told more);
    ``chat_template_kwargs``: extra variables for the worker's chat template (messages only)."""
    req = Request(
        id=check_request_id(request_id or new_request_id()),
        params=params if params is not None else SamplingParams(),
        deadline=deadline,
        priority=priority,
        metadata=dict(metadata or {}),
        created=time.time(),
        chat_template_kwargs=chat_template_kwargs,
    )
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        req.messages = [dict(m) for m in prompt]
    elif isinstance(prompt, (list, tuple)):
        req.prompt_token_ids = list(prompt)
    else:
        raise ProtocolError(
            f"prompt must be a str, a list of chat messages or a list of token ids, "
            f"got {type(prompt).__name__}",
            E_INVALID_REQUEST,
        )
    _validate_request(req)
    limits = limits or DEFAULT_LIMITS
    limits.check_params(req.params)
    try:
        size = len(encode_request(req))
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") has no UTF-8 form
        raise ProtocolError(
            f"the request's text holds {exc.object[exc.start:exc.end]!a}, which is not valid "
            "Unicode (a lone UTF-16 surrogate): send UTF-8 text", E_INVALID_REQUEST,
            req.id) from None
    except (ValueError, RecursionError) as exc:  # msgpack refuses what nests too deeply
        raise ProtocolError(f"the request cannot be encoded ({type(exc).__name__}): it nests "
                            "too deeply", E_INVALID_REQUEST, req.id) from None
    if size > limits.max_request_bytes:
        raise ProtocolError(f"the request is {size} bytes, over the queue's limit of "
                            f"{limits.max_request_bytes}: shorten the prompt", E_INVALID_REQUEST,
                            req.id)
    return req


def encode_request(req: Request) -> bytes:
    _validate_request(req)
    body = {
        "v": PROTOCOL_VERSION,
        "id": req.id,
        "params": req.params.to_dict(),
        "deadline": req.deadline,
        "priority": req.priority,
        "metadata": req.metadata,
        "created": req.created,
    }
    if req.prompt is not None:
        body["prompt"] = req.prompt
    if req.messages is not None:
        body["messages"] = req.messages
    if req.prompt_token_ids is not None:
        body["prompt_token_ids"] = req.prompt_token_ids
    if req.chat_template_kwargs is not None:  # absent when unset: older workers know no key
        body["chat_template_kwargs"] = req.chat_template_kwargs
    return msgpack.packb(body, use_bin_type=True)


def job_fields(req: Request) -> dict[bytes, bytes]:
    """The job stream entry for ``req``."""
    return {F_ID: req.id.encode(), F_PAYLOAD: encode_request(req)}


@dataclass(frozen=True)
class Limits:
    """What one job may ask of a worker: checked before anything is allocated for it.

    The SDK checks the defaults before enqueueing; a worker checks its own (``pagedq worker
    --max-n`` ...) and answers a job over them with ``invalid_params`` / ``invalid_request``.
    """

    max_request_bytes: int = 1 << 20  # the msgpack payload, checked before it is decoded
    max_n: int = 16
    max_logprobs: int = 20
    max_stop: int = 16  # entries of ``stop`` and of ``stop_token_ids``, each
    max_stop_chars: int = 256  # characters of one stop string

    def check_params(self, params: SamplingParams) -> None:
        """Raise InvalidParamsError naming the first parameter over a limit."""
        longest = max(map(len, params.stop), default=0)
        for what, value, limit, flag in (
                ("n", params.n, self.max_n, "n"),
                ("logprobs", params.logprobs or 0, self.max_logprobs, "logprobs"),
                ("prompt_logprobs", params.prompt_logprobs or 0, self.max_logprobs, "logprobs"),
                ("stop: strings", len(params.stop), self.max_stop, "stop"),
                ("stop_token_ids: ids", len(params.stop_token_ids), self.max_stop, "stop"),
                ("stop: characters in one string", longest, self.max_stop_chars,
                 "stop-chars")):
            if value > limit:
                raise InvalidParamsError(
                    f"SamplingParams.{what} = {value} is over this queue's limit of {limit} "
                    f"(the worker's --max-{flag}): lower it")


DEFAULT_LIMITS = Limits()


def request_digest(req: Request) -> str:
    """What makes two submissions the same job: the prompt (in whichever form) and the params.

    Deadline, priority, metadata and the creation time are left out, so a client retrying a
    submit (a new ``created``, a deadline recomputed from a timedelta) joins its first attempt.
    """
    params = sorted(req.params.to_dict().items())
    fields = [PROTOCOL_VERSION, req.prompt, req.messages, req.prompt_token_ids, params]
    if req.chat_template_kwargs is not None:  # unset: the digest of jobs sent before it existed
        fields.append(sorted(req.chat_template_kwargs.items()))
    body = msgpack.packb(fields, use_bin_type=True)
    return hashlib.sha256(body).hexdigest()


def _unpack(data: Any, request_id: str | None, limits: Limits) -> Any:
    if not isinstance(data, (bytes, bytearray)):
        what = "missing" if data is None else f"{type(data).__name__}, not bytes"
        raise ProtocolError(f"the entry's payload field 'p' is {what}: send the msgpack "
                            "request there", request_id=request_id)
    if len(data) > limits.max_request_bytes:
        raise ProtocolError(
            f"payload is {len(data)} bytes, over this queue's limit of "
            f"{limits.max_request_bytes} (the worker's --max-request-bytes): shorten the prompt",
            E_INVALID_REQUEST, request_id)
    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        why = str(exc) or type(exc).__name__
        raise ProtocolError(f"payload is not valid msgpack: {why}", request_id=request_id
                            ) from exc


def decode_request(data: Any, entry_id_hint: str | None = None,
                   limits: Limits = DEFAULT_LIMITS) -> Request:
    """Parse and validate a job payload; raise ProtocolError (with request_id when known).

    ``entry_id_hint`` is the entry's own ``id`` field. An error names a request id only when
    it is a valid one, so a worker never writes to keys built from an unchecked id.
    """
    hint = _safe_id(entry_id_hint)
    obj = _unpack(data, hint, limits)
    if not isinstance(obj, dict):
        raise ProtocolError("payload must be a msgpack map", request_id=hint)
    rid = obj.get("id", entry_id_hint)
    try:
        rid = check_request_id(rid)
    except ProtocolError as exc:
        exc.request_id = hint
        raise
    if entry_id_hint is not None and rid != entry_id_hint:
        raise ProtocolError(f"the entry's id field {entry_id_hint!r} and the payload's id "
                            f"{rid!r} differ: send the same id in both", E_INVALID_REQUEST, hint)
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this worker speaks "
            f"{PROTOCOL_VERSION}); upgrade the worker or the client",
            E_UNSUPPORTED_VERSION,
            rid,
        )
    try:
        params = SamplingParams.from_dict(obj.get("params") or {})
        limits.check_params(params)
    except InvalidParamsError as exc:
        raise ProtocolError(str(exc), E_INVALID_PARAMS, rid) from exc
    except Exception as exc:  # e.g. a comparison of incompatible types inside validate()
        raise ProtocolError(f"invalid sampling params: {exc}", E_INVALID_PARAMS, rid) from exc
    req = Request(
        id=rid,
        params=params,
        prompt=obj.get("prompt"),
        messages=obj.get("messages"),
        prompt_token_ids=obj.get("prompt_token_ids"),
        deadline=obj.get("deadline"),
        priority=obj.get("priority", 0),
        metadata=obj.get("metadata") or {},
        created=obj.get("created") or 0.0,
        chat_template_kwargs=obj.get("chat_template_kwargs"),
    )
    try:
        _validate_request(req)
    except ProtocolError as exc:
        exc.request_id = rid
        raise
    return req


def _safe_id(value: Any) -> str | None:
    try:
        return check_request_id(value)
    except ProtocolError:
        return None


def _validate_request(req: Request) -> None:
    def bad(msg: str) -> ProtocolError:
        return ProtocolError(msg, E_INVALID_REQUEST, _safe_id(req.id))

    given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
    if sum(given) != 1:
        raise bad("exactly one of prompt, messages, prompt_token_ids must be given")
    if req.prompt is not None and (not isinstance(req.prompt, str) or not req.prompt):
        raise bad("prompt must be a non-empty string")
    if req.messages is not None:
        if not isinstance(req.messages, list) or not req.messages:
            raise bad("messages must be a non-empty list of {role, content} maps")
        for m in req.messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise bad("each chat message must be a map with string 'role' and 'content'")
    if req.chat_template_kwargs is not None:
        if req.messages is None:
            raise bad("chat_template_kwargs works with chat messages only")
        try:
            check_template_kwargs(req.chat_template_kwargs)
        except ValueError as exc:
            raise bad(str(exc)) from None
    if req.prompt_token_ids is not None:
        ids = req.prompt_token_ids
        if not isinstance(ids, list) or not ids:
            raise bad("prompt_token_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in ids):
            raise bad("prompt_token_ids must be integers in [0, 2**31)")
    if req.deadline is not None and (
        not isinstance(req.deadline, (int, float)) or isinstance(req.deadline, bool)
        or not math.isfinite(req.deadline)
    ):
        raise bad("deadline must be a unix time in seconds (a finite number) or None")
    if (not isinstance(req.priority, int) or isinstance(req.priority, bool)
            or abs(req.priority) > MAX_ABS_PRIORITY):
        raise bad(f"priority must be an integer in [-{MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}]")
    if not isinstance(req.metadata, dict):
        raise bad("metadata must be a map")
    if (not isinstance(req.created, (int, float)) or isinstance(req.created, bool)
            or not math.isfinite(req.created)):
        raise bad("created must be a unix time in seconds")


# ---------------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------------


@dataclass
class Event:
    """One entry of a request's output stream.

    ``seq`` numbers a request's events 1, 2, 3, ... with no gap, whoever wrote them. A TOKENS
    event carries sample ``index``'s new ``token_ids`` and ``text`` and ``position`` = that
    sample's generated-token count after them, so its first token sits at
    ``position - len(token_ids)``. ``finish_reason`` is set on a sample's last TOKENS event.
    The terminal FINISHED event carries ``finish_reasons`` (per sample) and ``usage``.
    ``prompt_logprobs`` (a request that asked for them) rides on sample 0's first TOKENS event.
    """

    type: str
    request_id: str
    seq: int = 0
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    position: int = 0
    finish_reason: str | None = None
    finish_reasons: list[str | None] | None = None
    usage: dict[str, int] | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    error_code: str | None = None
    error: str | None = None
    worker: str | None = None
    entry_id: str | None = None  # the output stream entry id, to resume reading after it

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL


_EVENT_KEYS = ("index", "token_ids", "text", "position", "finish_reason", "finish_reasons",
               "usage", "logprobs", "error_code", "error", "worker")


def encode_event(ev: Event) -> bytes:
    """msgpack map without defaults; seq lives in the entry's own field (the publisher sets it)."""
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": ev.type, "id": ev.request_id}
    for key in _EVENT_KEYS:
        value = getattr(ev, key)
        if value is not None and value != [] and value != "":
            body[key] = value
    if ev.logprobs is not None:  # string-keyed maps only: [[token id, logprob], ...] per token
        body["logprobs"] = [[[int(t), float(lp)] for t, lp in d.items()] for d in ev.logprobs]
    if ev.prompt_logprobs is not None:
        body["prompt_logprobs"] = ev.prompt_logprobs.to_wire()
    return msgpack.packb(body, use_bin_type=True)


def decode_event(fields: dict[bytes, bytes], entry_id: str | bytes | None = None) -> Event:
    """Build an Event from an output stream entry's fields."""
    try:
        obj = msgpack.unpackb(fields[F_EVENT], raw=False, strict_map_key=False)
        seq = int(fields[F_SEQ])
    except Exception as exc:
        raise ProtocolError(f"corrupt output stream entry {entry_id!r}: {exc}") from exc
    if not isinstance(obj, dict) or obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"output event version {obj.get('v') if isinstance(obj, dict) else None!r} is not "
            f"supported by this client (speaks {PROTOCOL_VERSION}); upgrade the client",
            E_UNSUPPORTED_VERSION,
        )
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    ev = Event(type=obj["type"], request_id=obj.get("id", ""), seq=seq, entry_id=entry_id)
    for key in _EVENT_KEYS:
        if key in obj:
            setattr(ev, key, obj[key])
    if ev.logprobs is not None:
        ev.logprobs = [{int(t): float(lp) for t, lp in pairs} for pairs in ev.logprobs]
    if obj.get("prompt_logprobs") is not None:
        try:
            ev.prompt_logprobs = PromptLogprobs.from_wire(obj["prompt_logprobs"])
        except ValueError as exc:
            raise ProtocolError(f"output stream entry {entry_id!r}: {exc}") from exc
    return ev

