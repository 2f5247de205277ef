"""Offline use of the engine: ``generate``, ``chat`` and ``beam_search`` run whole batches to
completion on the same step API the queue worker drives, so there is one batching path to
trust, whichever way a request comes in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Sequence as Seq

from pagedq.errors import InvalidRequestError
from pagedq.params import SamplingParams
from pagedq.worker.engine.beam_search import BeamParams, beam_search
from pagedq.worker.engine.intake import chat_prompt
from pagedq.worker.engine.outputs import BeamSearchOutput, RequestOutput
from pagedq.worker.engine.sequence import Request
from pagedq.worker.engine.step_api import StepAPI


class OfflineAPI:
    """The batch-to-completion methods of Engine (a mixin: it uses the step API only)."""

    _offline_ids = itertools.count()

    def generate(self: StepAPI, prompts: Seq[str] | Seq[list[int]] | str,
                 params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(plist)} params for {len(prompts)} prompts")
        reqs = self.run_to_completion("offline", [
            lambda rid, prompt=prompt, p=p: self.add_request(rid, prompt, p)
            for prompt, p in zip(prompts, plist, strict=True)])
        return [r.output() for r in reqs]

    def chat(self: StepAPI, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | Seq[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (with
        ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``), then ``generate``."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        plist = (list(params) if isinstance(params, Seq) else [params] * len(conversations))
        return self.generate([self.apply_chat_template(c, p, chat_template_kwargs)
                              for c, p in zip(conversations, plist, strict=True)], params)

    def beam_search(self: StepAPI, prompts: Seq[str] | Seq[list[int]], beam_width: int = 4,
                    max_tokens: int = 16, length_penalty: float = 1.0,
                    ignore_eos: bool = False, prompt_logprobs: int | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search per prompt (beam_search.py); each result's ``beams`` are best first
        (and its ``prompt_logprobs``, when asked)."""
        return beam_search(self, prompts, BeamParams(beam_width, max_tokens, length_penalty,
                                                     ignore_eos, prompt_logprobs))

    def apply_chat_template(self: StepAPI, messages: list[dict],
                            params: SamplingParams | None = None,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """The prompt token ids of a conversation, ready for the assistant's turn (with the
        tools of ``params``' ``tools`` constraint listed, if it has one)."""
        return chat_prompt(self.tokenizer, self.model_path, messages, params,
                           chat_template_kwargs)

    def run_to_completion(self: StepAPI, kind: str, adders: list[Callable[[str], Request]]
                          ) -> list[Request]:
        """Add one request per adder under a fresh id (all or none: a bad one aborts those
        already added), then step until all of them have finished; raises the first error of
        a request rejected on the way."""
        ids = [f"{kind}-{next(OfflineAPI._offline_ids)}" for _ in adders]
        reqs: list[Request] = []
        try:
            for rid, add in zip(ids, adders, strict=True):
                reqs.append(add(rid))
        except Exception:
            for rid in ids:
                self.abort_request(rid)
            raise
        while any(rid in self.live for rid in ids) or self.live.pending:
            self.step()
        failed = self.live.take_rejected(set(ids))
        if failed:
            raise failed[0][1]
        return reqs
