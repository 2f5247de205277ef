"""The engine's step API as the offline helpers see it: a Protocol, not the Engine class.

``offline.py`` (generate, chat, beam search run to completion) and ``beam_search.py`` (a sampling
hook that forks and finishes beams) drive any object with these members. Naming the Protocol
instead of ``Engine`` keeps the imports one-way: engine.py imports them, they never import it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pagedq.params import SamplingParams
from pagedq.worker.engine.live_requests import LiveRequests
from pagedq.worker.engine.outputs import StepOutput
from pagedq.worker.engine.sequence import Request, SamplingHook, Sequence


class StepAPI(Protocol):
    """What Engine offers the offline helpers (see engine.py for each member's contract)."""

    tokenizer: Any
    model_path: Path
    max_model_len: int
    num_generated_tokens: int
    live: LiveRequests

    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    params: SamplingParams | dict | None = None, *,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    resume: list[list[int]] | None = None, deadline: float | None = None,
                    hook: SamplingHook | None = None) -> Request: ...

    def abort_request(self, request_id: str) -> bool: ...

    def step(self) -> list[StepOutput]: ...

    def fork(self, seq: Sequence, index: int) -> Sequence: ...

    def finish(self, seq: Sequence, reason: str | None = None) -> None: ...

    def run_to_completion(self, kind: str, adders: list[Callable[[str], Request]]
                          ) -> list[Request]: ...

    def apply_chat_template(self, messages: list[dict],
                            params: SamplingParams | None = None,
                            chat_template_kwargs: dict | None = None) -> list[int]: ...

    def generate(self, prompts: Any, params: Any = None) -> list[Any]: ...
