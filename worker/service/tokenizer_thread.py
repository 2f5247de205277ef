"""Intake: a job's prompt turned into token ids off the engine thread, and held to the limits.

Tokenizing a long text or rendering a chat takes time the engine thread must spend stepping
its batch, so it happens here, on a thread of its own with a tokenizer of its own (the engine
thread keeps detokenizing with the engine's). The payload was bounded in bytes before it was
decoded (protocol.Limits); the token count is checked here, before the engine sees the job.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedq.client.protocol import Request
from pagedq.errors import InvalidRequestError, RequestTooLongError


class Intake:
    """Tokenizes prompts for one engine and checks their length."""

    def __init__(self, engine: Any, max_prompt_tokens: int | None = None):
        tokenizer = getattr(engine, "tokenizer", None)
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.model_path = getattr(engine, "model_path", "the model")
        max_model_len = getattr(engine, "max_model_len", None)
        limits = [x for x in (max_prompt_tokens, max_model_len and max_model_len - 1) if x]
        self.max_prompt_tokens = min(limits) if limits else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedq-intake")

    async def prompt_ids(self, req: Request) -> list[int]:
        """The request's prompt as token ids; raises InvalidRequestError (no tokenizer, a bad
        chat) or RequestTooLongError."""
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
        else:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._pool, self._tokenize, req)
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise RequestTooLongError(
                f"prompt has {len(ids)} tokens; this worker accepts at most "
                f"{self.max_prompt_tokens} (--max-prompt-tokens, and the model's "
                "max_model_len): shorten the prompt")
        return ids

    def _tokenize(self, req: Request) -> list[int]:
        # torch: the service imports without it, so a worker announces "starting" on the queue
        # seconds before the engine's imports finish; torch is loaded by the time jobs arrive
        from pagedq.worker.engine.intake import chat_prompt

        if self.tokenizer is None:
            raise InvalidRequestError(
                f"model {self.model_path} has no tokenizer: send token ids instead of text")
        if req.messages is not None:
            return chat_prompt(self.tokenizer, self.model_path, req.messages, req.params,
                               req.chat_template_kwargs)
        return self.tokenizer(req.prompt).input_ids

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
