"""Queue events and results -> OpenAI JSON: chat and completion responses and stream chunks.

``ChunkRenderer`` turns each event of a job's output stream into the chunks of one SSE event,
keeping the little state chunks depend on (which choices got their finish_reason, the text
offsets of completion logprobs), so a resumed stream that re-reads the events from the start
renders exactly the chunks a single connection would have seen.
"""

from __future__ import annotations

from typing import Any

from pagedq.client import CompletionResult, Event, Result
from pagedq.client.protocol import FINISHED, TOKENS
from pagedq.gateway import tools
from pagedq.gateway.tokens import TokenText
from pagedq.gateway.translate import CHAT, View
from pagedq.logprobs import PromptLogprobs

NO_LOGPROB = -9999.0  # vLLM's stand-in where a token's logprob is unknown (-inf, or resumed)


def finish_reason(reason: str | None) -> str | None:
    """pagedq's reasons -> OpenAI's: stop and length pass; a deadline cut is a length cut."""
    if reason is None or reason in ("stop", "length"):
        return reason
    return "length"


def usage_json(usage: dict[str, int]) -> dict[str, int]:
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def sum_usage(results: list[Result]) -> dict[str, int]:
    total = {"prompt_tokens": 0, "completion_tokens": 0}
    for r in results:
        for key in total:
            total[key] += int(r.usage.get(key, 0))
    return usage_json(total)


class Logprobs:
    """Per-token logprob maps (top-k ids plus the sampled one) -> OpenAI's two shapes."""

    def __init__(self, k: int, token_text: TokenText):
        self.k = k
        self.text = token_text

    def _top(self, lp: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(lp.items(), key=lambda kv: -kv[1])[: self.k]

    def chat(self, token_ids: list[int], lps: list[dict[int, float]] | None) -> dict[str, Any]:
        content = []
        for token, lp in _pairs(token_ids, lps):
            text = self.text(token)
            content.append({
                "token": text, "logprob": lp.get(token, NO_LOGPROB),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": self.text(t), "logprob": v,
                                  "bytes": list(self.text(t).encode("utf-8"))}
                                 for t, v in self._top(lp)],
            })
        return {"content": content}

    def completion(self, token_ids: list[int], lps: list[dict[int, float]] | None,
                   offset: int) -> tuple[dict[str, Any], int]:
        """The completions shape, its text offsets starting at ``offset``; returns the end."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for token, lp in _pairs(token_ids, lps):
            text = self.text(token)
            top = dict(self._top(lp))
            top.setdefault(token, lp.get(token, NO_LOGPROB))  # vLLM lists the sampled one too
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.get(token, NO_LOGPROB))
            out["top_logprobs"].append({self.text(t): v for t, v in top.items()})
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset


def _finite(value: float) -> float:
    """vLLM's clamp: -inf (a banned or impossible token) becomes NO_LOGPROB in JSON."""
    return value if value > NO_LOGPROB else NO_LOGPROB


def prompt_logprobs_json(plp: PromptLogprobs | None, text: TokenText
                         ) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` field: None for the first token, then per token
    {"<id>": {"logprob", "rank", "decoded_token"}} for the prompt token and its top-k."""
    if plp is None:
        return None
    out: list[dict[str, Any] | None] = []
    for i, token in enumerate(plp.token_ids):
        if i == 0 or plp.logprobs[i] is None:
            out.append(None)
            continue
        entry = {str(token): {"logprob": _finite(plp.logprobs[i]), "rank": plp.ranks[i],
                              "decoded_token": text(token)}}
        for rank, (t, lp) in enumerate((plp.top[i] or {}).items(), start=1):
            entry.setdefault(str(t), {"logprob": _finite(lp), "rank": rank,
                                      "decoded_token": text(t)})
        out.append(entry)
    return out


def echo_logprobs(plp: PromptLogprobs | None, text: TokenText) -> dict[str, Any]:
    """The completions logprobs of an echoed prompt (OpenAI's shape): its tokens, their
    logprobs (None for the first), top_logprobs (None, then the top-k and the token itself)
    and text offsets from 0."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    offset = 0
    for i, entry in enumerate(plp.as_dicts() if plp is not None else []):
        token = plp.token_ids[i]
        out["tokens"].append(text(token))
        out["text_offset"].append(offset)
        offset += len(text(token))
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(entry[token]))
        top = {text(t): _finite(v) for t, v in list(entry.items())[1:]}
        top.setdefault(text(token), _finite(entry[token]))
        out["top_logprobs"].append(top)
    return out


def join_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """Two completions logprobs objects, one after the other."""
    return {k: head[k] + (tail or {}).get(k, []) for k in head}


def _pairs(token_ids: list[int], lps: list[dict[int, float]] | None):
    lps = list(lps or [])
    lps += [{}] * (len(token_ids) - len(lps))
    return zip(token_ids, lps, strict=False)


def response(view: View, request_id: str, results: list[Result],
             token_text: TokenText) -> dict[str, Any]:
    """The non-streamed chat.completion / text_completion body for a request's results."""
    lp = Logprobs(view.logprobs, token_text) if view.logprobs is not None else None
    choices = []
    for p, res in enumerate(results):
        for out in res.outputs:
            choice = _choice(view, lp, p * view.n + out.index, out, request_id)
            if view.kind != CHAT:
                _prompt_fields(view, choice, res.prompt_logprobs, token_text)
            choices.append(choice)
    obj = "chat.completion" if view.kind == CHAT else "text_completion"
    body = {"id": request_id, "object": obj, "created": view.created, "model": view.model,
            "choices": choices, "usage": sum_usage(results)}
    if view.kind == CHAT and view.prompt_logprobs is not None and results:
        body["prompt_logprobs"] = prompt_logprobs_json(results[0].prompt_logprobs, token_text)
    return body


def _choice(view: View, lp: Logprobs | None, index: int, out: CompletionResult,
            request_id: str = "") -> dict[str, Any]:
    reason = finish_reason(out.finish_reason)
    echo = view.echo or ""
    if view.kind == CHAT and view.tools:
        return tools.chat_choice(view.tools, request_id, index, out, reason,
                                 lp.chat(out.token_ids, out.logprobs) if lp else None,
                                 legacy=view.legacy_functions, prefix=echo,
                                 reasoning=view.reasoning, opened=view.reasoning_open)
    if view.kind == CHAT:
        return {"index": index, "message": {"role": "assistant", "content": echo + out.text},
                "logprobs": lp.chat(out.token_ids, out.logprobs) if lp else None,
                "finish_reason": reason}
    logprobs = lp.completion(out.token_ids, out.logprobs, len(echo))[0] if lp else None
    return {"index": index, "text": echo + out.text, "logprobs": logprobs,
            "finish_reason": reason}


def _prompt_fields(view: View, choice: dict[str, Any], plp: PromptLogprobs | None,
                   text: TokenText) -> None:
    """A completions choice's prompt logprobs: the echoed prompt's lead its ``logprobs``
    (echo + logprobs), and vLLM's ``prompt_logprobs`` field when that was asked."""
    if view.echo_logprobs:
        choice["logprobs"] = join_logprobs(echo_logprobs(plp, text), choice["logprobs"])
    if view.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(plp, text)


class ChunkRenderer:
    """A job's events, in order, -> the chunks of its SSE stream (one list per event)."""

    def __init__(self, view: View, request_id: str, token_text: TokenText):
        self.view = view
        self.id = request_id
        self.lp = Logprobs(view.logprobs, token_text) if view.logprobs is not None else None
        self.finished = [False] * view.n
        self.offsets = [len(view.echo or "")] * view.n
        self.object = "chat.completion.chunk" if view.kind == CHAT else "text_completion"
        self.tool_deltas = ([tools.ToolDeltas(view.tools, request_id, i, view.legacy_functions,
                                              view.reasoning, view.reasoning_open)
                             for i in range(view.n)] if view.tools else None)
        self.token_text = token_text
        self.prompt_lp: PromptLogprobs | None = None  # from sample 0's first event
        self.started = [False] * view.n  # whose first tokens chunk went out

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None
              ) -> dict[str, Any]:
        body = {"id": self.id, "object": self.object, "created": self.view.created,
                "model": self.view.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def opening(self) -> list[dict[str, Any]]:
        """What precedes the first event: the assistant role (chat, with an echoed last
        assistant message), the echoed prompt (completions)."""
        if self.view.kind == CHAT:
            echo = self.view.echo or ""
            return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": echo},
                                 "logprobs": None, "finish_reason": None}])
                    for i in range(self.view.n)]
        if self.view.echo and not self.view.echo_logprobs:  # else with the first tokens
            return [self.chunk([{"index": i, "text": self.view.echo, "logprobs": None,
                                 "finish_reason": None}]) for i in range(self.view.n)]
        return []

    def on_event(self, ev: Event) -> list[dict[str, Any]]:
        if ev.prompt_logprobs is not None and self.prompt_lp is None:
            self.prompt_lp = ev.prompt_logprobs
        if ev.type == TOKENS:
            return self._first(ev, self._tokens(ev))
        if ev.type == FINISHED:
            return self._finished(ev)
        return []

    def _tokens(self, ev: Event) -> list[dict[str, Any]]:
        i = ev.index
        if not 0 <= i < self.view.n:
            return []
        reason = finish_reason(ev.finish_reason)
        if reason is not None:
            self.finished[i] = True
        if not ev.text and reason is None and (self.lp is None or not ev.token_ids):
            return []  # tokens held back (a partial character or stop string): nothing to show
        if self.tool_deltas is not None:
            delta = self.tool_deltas[i].delta(ev.text, reason is not None)
            if not delta and reason is None and self.lp is None:
                return []  # the start of a call marker, held back
            choice = {"index": i, "delta": delta,
                      "logprobs": self.lp.chat(ev.token_ids, ev.logprobs) if self.lp else None,
                      "finish_reason": self.tool_deltas[i].finish_reason(reason)}
        elif self.view.kind == CHAT:
            choice = {"index": i, "delta": {"content": ev.text},
                      "logprobs": self.lp.chat(ev.token_ids, ev.logprobs) if self.lp else None,
                      "finish_reason": reason}
        else:
            logprobs = None
            if self.lp is not None:
                logprobs, self.offsets[i] = self.lp.completion(ev.token_ids, ev.logprobs,
                                                               self.offsets[i])
            choice = {"index": i, "text": ev.text, "logprobs": logprobs, "finish_reason": reason}
        return [self.chunk([choice])]

    def _first(self, ev: Event, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A sample's first chunk carries the prompt's logprobs: chat's and completions'
        ``prompt_logprobs`` field (vLLM's), and for echo + logprobs the echoed prompt with its
        logprobs ahead of the first tokens."""
        i = ev.index
        if not chunks or not 0 <= i < self.view.n or self.started[i]:
            return chunks
        self.started[i] = True
        choice = chunks[0]["choices"][0]
        if self.view.kind == CHAT:
            if self.view.prompt_logprobs is not None:
                chunks[0]["prompt_logprobs"] = prompt_logprobs_json(self.prompt_lp,
                                                                    self.token_text)
            return chunks
        if self.view.echo_logprobs:
            choice["text"] = self.view.echo + choice["text"]
        _prompt_fields(self.view, choice, self.prompt_lp, self.token_text)
        return chunks

    def _finished(self, ev: Event) -> list[dict[str, Any]]:
        """Finish reasons no tokens event carried (a job ended by its deadline), then usage."""
        chunks = []
        reasons = list(ev.finish_reasons or [])
        for i in range(self.view.n):
            if self.finished[i]:
                continue
            reason = finish_reason(reasons[i] if i < len(reasons) else None) or "stop"
            if self.tool_deltas is not None:
                reason = self.tool_deltas[i].finish_reason(reason)
            self.finished[i] = True
            empty = {"delta": {}} if self.view.kind == CHAT else {"text": ""}
            chunks.append(self.chunk([{"index": i, **empty, "logprobs": None,
                                       "finish_reason": reason}]))
        if self.view.include_usage:
            chunks.append(self.chunk([], usage_json(ev.usage or {})))
        return chunks
