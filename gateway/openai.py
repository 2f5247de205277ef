"""The OpenAI request bodies the gateway accepts, as pydantic models.

Field names and defaults follow OpenAI's API reference; vLLM's extra body fields (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``priority``,
``structured_outputs`` and the older ``guided_*`` names, ``prompt_logprobs``) are accepted as
vLLM accepts them, and pagedq's own ``speculative`` (false: no speculative decoding for this request).
Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI fields keep
working; fields whose meaning pagedq cannot honour (best_of > n, suffix) are
refused in translate.py with a 400 that says so. ``tools`` are translated in tools.py, and so
are the deprecated ``functions`` / ``function_call`` (as OpenAI still serves them: one call,
answered as ``message.function_call``). Chat's ``echo`` is vLLM's: the reply starts with the
last message's text when that message is the assistant's.
Ranges are checked by ``SamplingParams`` itself, so the gateway and the engine can never
disagree about what is valid.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Sampling(_Body):
    """The sampling fields chat and completions share."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra body fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    speculative: bool | None = None  # pagedq's: false turns speculative decoding off for it
    priority: int = 0  # vLLM's sense: lower runs earlier
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, + top-k


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # deprecated: tools with one call
    function_call: str | dict[str, Any] | None = None  # deprecated: tool_choice for functions
    echo: bool = False  # vLLM's: prepend the last message's text when it is the assistant's
    # vLLM's and SGLang's: extra variables for the chat template ({"enable_thinking": false});
    # any JSON here, checked in translate.py so a bad one is a 400 that names the field
    chat_template_kwargs: Any = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class BatchCreateRequest(_Body):
    input_file_id: str = Field(max_length=256)
    endpoint: str = Field(max_length=256)
    completion_window: str = Field(default="24h", max_length=16)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)  # OpenAI: 16 pairs

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if len(key) > 64 or len(text) > 512:
                raise ValueError("metadata keys are at most 64 characters and values at most "
                                 "512 (OpenAI's limits)")
        return value
