"""Token id -> text for logprobs, from the model's tokenizer file.

The gateway runs no model, but OpenAI's logprobs name each token by its text. Workers report
their model's directory in their checkpoints; where that directory is readable here (one
machine, or a shared model volume) its ``tokenizer.json`` gives the texts. Elsewhere tokens
are named ``token_id:N``, vLLM's ``return_tokens_as_token_ids`` form, so nothing breaks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from pagedq.logging import get_logger

log = get_logger("pagedq.gateway.tokens")

TokenText = Callable[[int], str]


def token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


class TokenTexts:
    """One tokenizer per model directory, loaded on first use (tokenizers only: no torch)."""

    def __init__(self) -> None:
        self._by_path: dict[str, TokenText] = {}

    def lookup(self, model_path: str | None) -> TokenText:
        if not model_path:
            return token_id_text
        if model_path not in self._by_path:
            self._by_path[model_path] = self._load(Path(model_path))
        return self._by_path[model_path]

    @staticmethod
    def _load(path: Path) -> TokenText:
        file = path / "tokenizer.json"
        if not file.is_file():
            log.info("no tokenizer.json readable here; logprobs name tokens by id",
                     model=str(path))
            return token_id_text

        tokenizer = Tokenizer.from_file(str(file))
        cache: dict[int, str] = {}

        def text(token_id: int) -> str:
            if token_id not in cache:
                cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
            return cache[token_id]

        return text
