"""Reasoning before tool calls: Qwen3's (and DeepSeek-R1's) ``<think>...</think>`` block.

A thinking model writes its reasoning first, then its answer or its calls. With tools, the
reasoning stays free (the grammar allows one optional ``<think>`` block, any text, up to
``</think>`` and the blank line Qwen3 writes after it) and the calls after it are constrained,
under every tool choice: vLLM's reasoning parsers do the same (structured output starts when
the reasoning ends). The gateway returns the block as ``message.reasoning_content`` (and
``reasoning``, vLLM's newer name), not as content, and never reads a call marker inside it as
a call.

Where the reasoning starts is read from the rendered prompt's tail (``prompt_thinking``), not
from the model's name: some templates (Qwen3 thinking-2507, QwQ) end the generation prompt with
``<think>\n`` themselves, so the output starts inside the reasoning with no opening tag
(``OPEN``: the grammar and the splitter start in the thinking state, and the block is not
optional); Qwen3's ``enable_thinking=False`` ends it with an empty ``<think>\n\n</think>\n\n``
(``CLOSED``: no reasoning to expect, the output is the answer); otherwise the model may open a
block itself (``FREE``).

Nothing here imports torch or a grammar library (the SDK uses it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_BEGIN = "<think>"
THINK_END = "</think>"
THINK_TAIL = "\n\n"  # Qwen3 writes a blank line between the reasoning and the answer
FREE, OPEN, CLOSED = "free", "open", "closed"  # prompt_thinking's answers


def prompt_thinking(prompt: str) -> str:
    """How a rendered prompt leaves the reasoning: ``OPEN`` (it ends inside ``<think>``: the
    output starts in the reasoning), ``CLOSED`` (it ends with a closed block: thinking is off)
    or ``FREE`` (the model may open a block itself)."""
    tail = prompt.rstrip()
    if tail.endswith(THINK_BEGIN):
        return OPEN
    if tail.endswith(THINK_END):
        return CLOSED
    return FREE


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template renders ``<think>`` reasoning (Qwen3, QwQ, DeepSeek-R1)."""
    return bool(chat_template) and THINK_END in chat_template


def think_tag(inner: dict[str, Any], opened: bool = False) -> dict[str, Any]:
    """xgrammar's structural-tag format: an optional reasoning block, then ``inner``;
    ``opened``: the prompt opened the block, so the output starts inside it (free text up to
    ``</think>``, which it must write before ``inner``)."""
    block = {"type": "tag", "begin": "" if opened else THINK_BEGIN,
             "content": {"type": "any_text"}, "end": THINK_END + THINK_TAIL}
    first = block if opened else {"type": "optional", "content": block}
    return {"type": "sequence", "elements": [first, inner]}


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, the rest) of a whole output; an unclosed block is all reasoning.
    ``opened``: the prompt opened the block (``OPEN``), the text starts inside it."""
    splitter = ReasoningSplitter.after(opened)
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

    @classmethod
    def after(cls, opened: bool) -> ReasoningSplitter:
        """A splitter for an output whose prompt opened the block (``opened``) or did not."""
        return cls(state="think", thought=True) if opened else cls()

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
