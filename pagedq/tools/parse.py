"""Output text -> tool calls, incrementally: what a stream sends as it arrives, whole at the end.

The output was generated under the format's grammar, so the parser needs no guessing: text
until the format's trigger is content; then ``BEGIN name MIDDLE``; then the arguments object,
whose end is where its braces balance (outside strings); then ``END``. A list format (older
Mistral's ``[TOOL_CALLS] [{...}, {...}]``) has the list's opening after the trigger and, after
each call, either the separator and the next call or the list's closing. Each argument fragment
is passed on as soon as it arrives, so a stream's ``delta.tool_calls[].function.arguments``
concatenate to exactly the arguments' JSON. Call ids are derived from the request id, the
choice and the call's position, so a resumed stream renders the same ids again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from pagedq.tools.formats import ToolFormat

TEXT, OPEN, HEAD, ARGS, END, NEXT = "text", "open", "head", "args", "end", "next"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object's JSON text, as the model wrote it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def call_id(request_id: str, choice: int, k: int) -> str:
    digest = hashlib.sha256(f"{request_id}:{choice}:{k}".encode()).hexdigest()
    return f"call_{digest[:24]}"


@dataclass
class ToolCallParser:
    """Feed it the output text in pieces; each ``feed`` says what became visible."""

    fmt: ToolFormat
    request_id: str = ""
    choice: int = 0
    calls: list[ToolCall] = field(default_factory=list)
    state: str = TEXT
    buf: str = ""
    _call_start: str = ""  # the current call's raw text (returned as content if it never ends)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content text, OpenAI ``delta.tool_calls`` items) that ``text`` completes."""
        self.buf += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while True:
            before = (self.state, len(self.buf))
            getattr(self, f"_{self.state}")(content, deltas)
            if (self.state, len(self.buf)) == before:
                break
        return "".join(content), _merge(deltas)

    def finish(self) -> str:
        """Text held back at the end: a trigger's prefix, or a call that never ended."""
        rest = (self._call_start if self.state != TEXT else "") + self.buf
        self.buf, self._call_start, self.state = "", "", TEXT
        return rest

    @property
    def finished_calls(self) -> list[ToolCall]:
        """The calls whose text ended (a call still open is not one)."""
        return self.calls[:-1] if self.state in (ARGS, END) else self.calls

    # -- states ------------------------------------------------------------------------
    def _text(self, content: list[str], deltas: list[dict[str, Any]]) -> None:
        trigger = self.fmt.trigger
        at = self.buf.find(trigger)
        if at < 0:
            at = len(self.buf) - _held(self.buf, trigger)
            self._emit_text(self.buf[:at], content)
            self.buf = self.buf[at:]
            return
        self._emit_text(self.buf[:at], content)
        self.buf = self.buf[at:]
        self.state, self._call_start = (OPEN if self.fmt.is_list else HEAD), ""

    def _open(self, content: list[str], deltas: list[dict[str, Any]]) -> None:
        """A list format: the trigger, then the list's opening (its leading space optional)."""
        trigger, opening = self.fmt.trigger, self.fmt.opening.lstrip()
        rest = self.buf[len(trigger):].lstrip()
        if len(rest) < len(opening) and opening.startswith(rest):
            return
        if not rest.startswith(opening):
            content.append(trigger)  # not a list after all (unconstrained text)
            self.buf = self.buf[len(trigger):]
            self.state = TEXT
            return
        cut = len(self.buf) - len(rest) + len(opening)
        self._call_start, self.buf, self.state = self.buf[:cut], self.buf[cut:], HEAD

    def _next(self, content: list[str], deltas: list[dict[str, Any]]) -> None:
        """A list format, after a call: the separator and the next call, or the closing."""
        rest = self.buf.lstrip()
        sep, closing = self.fmt.separator.strip(), self.fmt.closing
        if rest.startswith(sep):
            self.buf, self.state = rest[len(sep):].lstrip(), HEAD
        elif rest.startswith(closing):
            self.buf, self.state = rest[len(closing):], TEXT
        elif rest:
            self.state = TEXT  # unconstrained text: whatever follows is content

    def _emit_text(self, text: str, content: list[str]) -> None:
        if text and not (self.calls and text.strip() in ("", self.fmt.separator.strip())):
            content.append(text)

    def _head(self, content: list[str], deltas: list[dict[str, Any]]) -> None:
        begin, middle = self.fmt.begin, self.fmt.middle
        if self.fmt.is_list:  # whitespace may follow the separator
            self.buf = self.buf.lstrip()
        if not (self.buf.startswith(begin) or begin.startswith(self.buf)) and self.fmt.is_list:
            self.state = TEXT  # unconstrained text: whatever follows is content
            return
        if not (self.buf.startswith(begin) or begin.startswith(self.buf)):
            content.append(self.fmt.trigger)  # not a call after all (unconstrained text)
            self.buf = self.buf[len(self.fmt.trigger):]
            self.state = TEXT
            return
        j = self.buf.find(middle, len(begin))
        if j < 0:
            return
        name = self.buf[len(begin):j]
        call = ToolCall(call_id(self.request_id, self.choice, len(self.calls)), name, "")
        self.calls.append(call)
        deltas.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                       "function": {"name": name, "arguments": ""}})
        self._call_start = self.buf[:j + len(middle)]
        self.buf = self.buf[j + len(middle):]
        self.state, self._depth, self._in_string, self._escaped = ARGS, 0, False, False

    def _args(self, content: list[str], deltas: list[dict[str, Any]]) -> None:
        end = _object_end(self, self.buf)
        piece = self.buf if end is None else self.buf[:end]
        if piece:
            self.calls[-1].arguments += piece
            self._call_start += piece
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
        self.buf = self.buf[len(piece):]
        if end is not None:
            self.state = END

    def _end(self, content: list[str], deltas: list[dict[str, Any]]) -> None:
        end = self.fmt.end
        if len(self.buf) < len(end) and end.startswith(self.buf):
            return
        if self.buf.startswith(end):
            self.buf = self.buf[len(end):]
        self.state, self._call_start = (NEXT if self.fmt.is_list else TEXT), ""


def _object_end(p: ToolCallParser, text: str) -> int | None:
    """Where the arguments object closes in ``text`` (the index after its last brace), with
    ``p``'s scan state carried over from earlier pieces; None while it is still open."""
    for i, ch in enumerate(text):
        if p._in_string:
            if p._escaped:
                p._escaped = False
            elif ch == "\\":
                p._escaped = True
            elif ch == '"':
                p._in_string = False
        elif ch == '"':
            p._in_string = True
        elif ch in "{[":
            p._depth += 1
        elif ch in "}]":
            p._depth -= 1
            if p._depth == 0:
                return i + 1
    return None


def _held(text: str, trigger: str) -> int:
    """How many of ``text``'s last characters could begin ``trigger`` (held back)."""
    for k in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-k:]):
            return k
    return 0


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent argument fragments of one call in one item."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and "id" not in d and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append(d)
    return out


def parse_tool_calls(text: str, fmt: ToolFormat, request_id: str = "", choice: int = 0
                     ) -> tuple[str, list[ToolCall]]:
    """(content, finished calls) of a whole output; a call cut short stays in the content."""
    parser = ToolCallParser(fmt, request_id, choice)
    content, _ = parser.feed(text)
    calls = parser.finished_calls
    return content + parser.finish(), calls
