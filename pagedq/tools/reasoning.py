"""Reasoning before tool calls: Qwen3's (and DeepSeek-R1's) ``<think>...</think>`` block.

A thinking model writes its reasoning first, then its answer or its calls. With tools, the
reasoning stays free (the grammar allows one optional ``<think>`` block, any text, up to
``</think>`` and the blank line Qwen3 writes after it) and the calls after it are constrained,
under every tool choice: vLLM's reasoning parsers do the same (structured output starts when
the reasoning ends). The gateway returns the block as ``message.reasoning_content`` (and
``reasoning``, vLLM's newer name), not as content, and never reads a call marker inside it as
a call.

Nothing here imports torch or a grammar library (the SDK uses it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_BEGIN = "<think>"
THINK_END = "</think>"
THINK_TAIL = "\n\n"  # Qwen3 writes a blank line between the reasoning and the answer


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template renders ``<think>`` reasoning (Qwen3, QwQ, DeepSeek-R1)."""
    return bool(chat_template) and THINK_END in chat_template


def think_tag(inner: dict[str, Any]) -> dict[str, Any]:
    """xgrammar's structural-tag format: an optional reasoning block, then ``inner``."""
    block = {"type": "tag", "begin": THINK_BEGIN, "content": {"type": "any_text"},
             "end": THINK_END + THINK_TAIL}
    return {"type": "sequence", "elements": [{"type": "optional", "content": block}, inner]}


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning or None, the rest) of a whole output; an unclosed block is all reasoning."""
    splitter = ReasoningSplitter()
    reasoning, rest = splitter.feed(text)
    more, tail = splitter.finish()
    reasoning += more
    return (reasoning if splitter.thought else None), rest + tail


@dataclass
class ReasoningSplitter:
    """Feed a stream's text in pieces; each ``feed`` returns (reasoning, answer text) that
    became certain. Text that may still turn out to be ``<think>`` or ``</think>`` waits."""

    state: str = "start"  # start -> think -> gap -> answer, or start -> answer
    buf: str = ""
    thought: bool = False  # a reasoning block was seen

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        if self.state == "start":
            head = self.buf.lstrip()
            if len(head) < len(THINK_BEGIN) and THINK_BEGIN.startswith(head):
                return "", ""
            if not head.startswith(THINK_BEGIN):
                self.state = "answer"
            else:
                self.state, self.thought = "think", True
                self.buf = head[len(THINK_BEGIN):]
        thought = ""
        if self.state == "think":
            thought = self._think()
        if self.state == "gap":  # the blank line after </think> is neither
            self.buf = self.buf.lstrip("\n")
            if self.buf:
                self.state = "answer"
        if self.state != "answer":
            return thought, ""
        out, self.buf = self.buf, ""
        return thought, out

    def _think(self) -> str:
        at = self.buf.find(THINK_END)
        if at < 0:
            keep = _held(self.buf, THINK_END)
            out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            return out
        reasoning, self.buf = self.buf[:at], self.buf[at + len(THINK_END):]
        self.state = "gap"
        return reasoning

    def finish(self) -> tuple[str, str]:
        """What was held back at the end: (reasoning, answer text)."""
        out, self.buf = self.buf, ""
        return (out, "") if self.state == "think" else ("", out)


def _held(text: str, marker: str) -> int:
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
