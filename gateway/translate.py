"""OpenAI request bodies -> queue jobs: prompts, ``SamplingParams`` and a priority.

One chat request is one job (its ``n`` samples ride in the job); one completions request is
one job per prompt. Everything a resumed stream needs to render chunks the same way again
(the endpoint, the model name, the logprobs setting, ...) is kept in a ``View``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedq.client import AsyncClient, AsyncRequestHandle
from pagedq.client.protocol import ProtocolError, build_request
from pagedq.errors import InvalidParamsError
from pagedq.gateway.api_errors import bad_request, invalid_params
from pagedq.gateway.openai import ChatCompletionRequest, CompletionRequest, Sampling
from pagedq.gateway.tools import legacy_functions, tool_constraint, wire_messages
from pagedq.params import SamplingParams
from pagedq.tools.prompt import check_template_kwargs
from pagedq.tools.reasoning import CLOSED, FREE, OPEN

CHAT = "chat"
COMPLETION = "completion"
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


@dataclass
class View:
    """How a job's events become OpenAI JSON; stored with the job so any gateway can resume
    its stream. ``logprobs``: None (off), else how many top alternatives to show."""

    kind: str
    model: str
    created: int
    n: int = 1
    include_usage: bool = False
    logprobs: int | None = None
    echo: str | None = None
    tools: str | None = None  # the tool-call format the output is constrained to (tools.py)
    prompt_logprobs: int | None = None  # vLLM's field asked: answer it as vLLM does (render.py)
    echo_logprobs: bool = False  # completions echo + logprobs: the prompt's logprobs lead
    legacy_functions: bool = False  # the request sent the deprecated functions (tools.py)
    reasoning: bool = False  # tools on a thinking model: <think> is reasoning_content (tools.py)
    reasoning_open: bool = False  # ... and the prompt opened <think>: the output starts in it

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> View:
        return cls(**json.loads(text))


@dataclass
class JobSpec:
    """What one OpenAI request becomes: one job per prompt, all with the same params."""

    id: str
    view: View
    prompts: list[Any]
    params: SamplingParams
    priority: int
    stream: bool = False
    job_ids: list[str] = field(default_factory=list)
    chat_template_kwargs: dict[str, Any] | None = None  # chat: for the worker's template

    def __post_init__(self) -> None:
        if not self.job_ids:
            self.job_ids = ([self.id] if len(self.prompts) == 1
                            else [f"{self.id}-{i}" for i in range(len(self.prompts))])


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex


def chat_spec(req: ChatCompletionRequest, request_id: str | None = None,
              priority_floor: int | None = None) -> JobSpec:
    legacy = legacy_functions(req)
    try:
        template_kwargs = check_template_kwargs(req.chat_template_kwargs)
    except ValueError as exc:
        raise bad_request(str(exc), "chat_template_kwargs") from exc
    constraint = tool_constraint(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    params = sampling_params(req, max_tokens, logprobs, constraint, req.prompt_logprobs)
    bases = [_message(m.role, m.content) for m in req.messages]
    messages = wire_messages(req.messages, bases)
    echo = bases[-1]["content"] if req.echo and req.messages[-1].role == "assistant" else None
    view = View(CHAT, req.model, int(time.time()), req.n, _include_usage(req), logprobs,
                echo or None, tools=constraint["tools"]["format"] if constraint else None,
                legacy_functions=legacy and constraint is not None,
                prompt_logprobs=req.prompt_logprobs)
    return JobSpec(request_id or new_id(CHAT), view, [messages], params,
                   _priority(req.priority, priority_floor), req.stream,
                   chat_template_kwargs=template_kwargs)


def completion_spec(req: CompletionRequest, request_id: str | None = None,
                    priority_floor: int | None = None) -> JobSpec:
    if req.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (candidates are not ranked server-side)",
                          "best_of")
    prompts = _prompts(req.prompt)
    if req.stream and len(prompts) > 1:
        raise bad_request("a streamed completion takes one prompt; send one request per prompt",
                          "prompt")
    echo = None
    if req.echo:
        if not isinstance(prompts[0], str) or len(prompts) > 1:
            raise bad_request("echo works with one text prompt", "echo")
        echo = prompts[0]
    echo_logprobs = echo is not None and req.logprobs is not None
    # vLLM's: echo with logprobs asks the prompt's logprobs at the same top-k
    prompt_logprobs = req.prompt_logprobs
    if echo_logprobs and prompt_logprobs is None:
        prompt_logprobs = req.logprobs
    params = sampling_params(req, req.max_tokens, req.logprobs, None, prompt_logprobs)
    view = View(COMPLETION, req.model, int(time.time()), req.n, _include_usage(req),
                req.logprobs, echo, prompt_logprobs=req.prompt_logprobs,
                echo_logprobs=echo_logprobs)
    return JobSpec(request_id or new_id(COMPLETION), view, prompts, params,
                   _priority(req.priority, priority_floor), req.stream)


def use_tool_format(spec: JobSpec, fmt: str, reasoning: bool = False,
                    thinking: str = FREE) -> None:
    """Constrain a spec's tool calls to ``fmt``, the served model's format (tools.py): known
    once the request's model is resolved to a path, after the spec was built with Hermes.
    ``reasoning``: the model thinks first (``<think>``) and its answer reports it as
    ``reasoning_content`` (pagedq.tools.reasoning); ``thinking``: where the rendered prompt
    leaves the reasoning (thinking.py): ``OPEN``, the output starts inside the block;
    ``CLOSED`` (thinking off), no reasoning to expect; ``FREE``, the model may open one."""
    so = spec.params.structured_outputs
    if spec.view.tools is None or so is None or so.tools is None:
        return
    so.tools["format"] = fmt
    spec.view.tools = fmt
    so.tools.pop("reasoning", None)
    so.tools.pop("reasoning_open", None)
    spec.view.reasoning = spec.view.reasoning_open = False
    if reasoning and thinking != CLOSED:
        so.tools["reasoning"] = spec.view.reasoning = True
        if thinking == OPEN:
            so.tools["reasoning_open"] = spec.view.reasoning_open = True


def sampling_params(req: Sampling, max_tokens: int | None, logprobs: int | None,
                    tools: dict[str, Any] | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams; its own validation message becomes the 400. ``tools``: the
    request's tool constraint (tools.py), which excludes any other."""
    given: dict[str, Any] = {
        "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens,
        "stop_token_ids": req.stop_token_ids, "skip_special_tokens": req.skip_special_tokens,
        "speculative": req.speculative,
        "stop": [req.stop] if isinstance(req.stop, str) else req.stop,
        "logprobs": logprobs, "logit_bias": req.logit_bias or None,
        "prompt_logprobs": prompt_logprobs,
    }
    data = {k: v for k, v in given.items() if v is not None}
    data["max_tokens"] = max_tokens  # None: up to the model's length
    constraint = structured_outputs(req)
    if tools is not None and constraint is not None:
        raise bad_request("tools with tool_choice other than 'none' take no other constraint "
                          "(response_format, structured_outputs, guided_*)", "tools")
    constraint = tools or constraint
    if constraint is not None:
        data["structured_outputs"] = constraint
    try:
        return SamplingParams.from_dict(data)
    except InvalidParamsError as exc:
        raise invalid_params(exc) from exc


def structured_outputs(req: Sampling) -> dict[str, Any] | None:
    """response_format, vLLM's structured_outputs or its older guided_* fields, as the one
    ``structured_outputs`` dict SamplingParams takes (keys json/json_object/regex/choice/grammar)."""
    found: list[dict[str, Any]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append({"json_object": True})
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema",
                              "response_format")
        found.append({"json": fmt.json_schema.schema_})
    if req.structured_outputs:
        found.append(dict(req.structured_outputs))
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice,
              "grammar": req.guided_grammar}
    found += [{k: v} for k, v in guided.items() if v is not None]
    if len(found) > 1:
        raise bad_request("give one constraint: response_format, structured_outputs or one "
                          "guided_* field", "response_format")
    return found[0] if found else None


def _include_usage(req: Sampling) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _priority(vllm_priority: int, floor: int | None) -> int:
    """vLLM's priority runs lower values first; pagedq's runs higher first (sign: level)."""
    priority = -vllm_priority
    return priority if floor is None else min(priority, floor)


def _message(role: str, content: str | list[dict[str, Any]] | None) -> dict[str, str]:
    """OpenAI content parts -> the plain text the worker's chat template takes."""
    if content is None:
        return {"role": role, "content": ""}
    if isinstance(content, str):
        return {"role": role, "content": content}
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"content parts of type {part.get('type')!r} are not supported; "
                              "send text parts", "messages")
        texts.append(part["text"])
    return {"role": role, "content": "\n".join(texts)}


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


async def submit(client: AsyncClient, spec: JobSpec) -> list[AsyncRequestHandle]:
    """Enqueue the spec's jobs; a prompt the protocol refuses is a 400 before any is sent."""
    for job_id, prompt in zip(spec.job_ids, spec.prompts, strict=True):
        try:
            build_request(prompt, spec.params, request_id=job_id, priority=spec.priority,
                          chat_template_kwargs=spec.chat_template_kwargs)
        except ProtocolError as exc:
            raise bad_request(str(exc), "messages" if spec.view.kind == CHAT else "prompt",
                              exc.code) from exc
        except InvalidParamsError as exc:  # over the queue's limits (n, stop, ...)
            raise invalid_params(exc) from exc
    return [await client.submit(prompt, spec.params, priority=spec.priority, request_id=job_id,
                                chat_template_kwargs=spec.chat_template_kwargs)
            for job_id, prompt in zip(spec.job_ids, spec.prompts, strict=True)]
