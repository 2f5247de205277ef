"""After sampling: append the token, detokenize, decide whether the sequence stops, and cut
the stream delta.

Stops, in vLLM's order: EOS (unless ignore_eos) and ``stop_token_ids`` (their text is not
added), then max_tokens / max_model_len, then stop strings found in the detokenized text across
token boundaries (the text is cut before the stop string). A stream never shows text that a
later stop string could still remove: a tail that may grow into a stop string is held back.
"""

from __future__ import annotations

from pagedq.logprobs import PromptLogprobs
from pagedq.worker.engine.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_len
from pagedq.worker.engine.outputs import StepOutput
from pagedq.worker.engine.sequence import SeqStatus, Sequence


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def start(self, seq: Sequence, resumed: list[int]) -> None:
        """Set up a sequence's output state; replay tokens a previous owner already streamed."""
        p = seq.params
        seq.detok = IncrementalDetokenizer(
            self.tokenizer, seq.token_ids[:seq.num_prompt_tokens], p.skip_special_tokens)
        if p.logprobs is not None:
            seq.logprobs = seq.logprobs or []
        if not resumed:
            return
        del seq.token_ids[seq.num_prompt_tokens:]
        for token in resumed:
            self._accept(seq, token)
            if seq.is_finished:
                break
        seq.num_resumed_tokens = seq.num_emitted_tokens = seq.num_generated
        seq.num_emitted_chars = self._visible_chars(seq)

    def append(self, seq: Sequence, token: int, logprob: float | None,
               top: dict[int, float] | None, complete: bool = False) -> StepOutput:
        """Add one sampled token; returns the sequence's stream delta for this step.
        ``complete``: the token ends the sequence's structured output (its stop token), which
        stops it even under ignore_eos or min_tokens."""
        self.add(seq, token, logprob, top, complete)
        return self.delta(seq)

    def add(self, seq: Sequence, token: int, logprob: float | None,
            top: dict[int, float] | None, complete: bool = False) -> None:
        """``append`` without cutting the delta: a step that yields several tokens for one
        sequence (verified drafts) adds them one by one and cuts one delta after the last."""
        if logprob is not None:
            seq.cum_logprob += logprob
        if top is not None and seq.logprobs is not None:
            seq.logprobs.append(top)
        self._accept(seq, token, complete)

    def delta(self, seq: Sequence) -> StepOutput:
        """What the sequence produced since its last delta (also its last one, once finished)."""
        new_tokens = seq.output_token_ids[seq.num_emitted_tokens:]
        visible = self._visible_chars(seq)
        new_text = seq.text[seq.num_emitted_chars:visible]
        new_lp = None
        if seq.logprobs is not None:
            new_lp = seq.logprobs[len(seq.logprobs) - len(new_tokens):] if new_tokens else []
        seq.num_emitted_tokens = seq.num_generated
        seq.num_emitted_chars = visible
        usage = {}
        if seq.is_finished:
            usage = {"prompt_tokens": seq.num_prompt_tokens,
                     "completion_tokens": seq.num_generated}
        return StepOutput(seq.request.request_id, seq.index, new_tokens, new_text,
                          seq.num_generated, seq.is_finished, seq.finish_reason, new_lp, usage,
                          take_prompt_logprobs(seq))

    # -- internals ------------------------------------------------------------------------
    def _accept(self, seq: Sequence, token: int, complete: bool = False) -> None:
        p = seq.params
        seq.token_ids.append(token)
        if complete:
            return self._stop(seq, "stop", None)
        if seq.num_generated >= p.min_tokens:
            if not p.ignore_eos and token in seq.request.eos_token_ids:
                return self._stop(seq, "stop", None)
            if token in p.stop_token_ids:
                return self._stop(seq, "stop", token)
        old_len = len(seq.text)
        seq.text += seq.detok.append([token])
        if p.stop and seq.num_generated >= p.min_tokens:
            hit = find_stop(seq.text, old_len, p.stop)
            if hit is not None:
                seq.text = seq.text[:hit[0]]
                return self._stop(seq, "stop", hit[1])
        if seq.num_generated >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._stop(seq, "length", None)

    def _stop(self, seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if stop_reason is None or isinstance(stop_reason, int):
            seq.text += seq.detok.flush()

    def _visible_chars(self, seq: Sequence) -> int:
        """Characters of ``seq.text`` a stream may show now."""
        if seq.is_finished or not seq.params.stop:
            return len(seq.text)
        return len(seq.text) - partial_stop_len(seq.text, seq.params.stop)


def take_prompt_logprobs(seq: Sequence) -> PromptLogprobs | None:
    """The request's prompt logprobs for sample 0's first delta once they are complete."""
    col = seq.request.prompt_logprobs
    return col.take() if col is not None and seq.index == 0 else None
