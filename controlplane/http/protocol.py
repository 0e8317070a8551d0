"""Pydantic models of the OpenAI-compatible request bodies (completions, chat completions,
tokenize, detokenize) with vLLM's sampling extras, and the OpenAI error object. Unknown fields
are ignored, as OpenAI's and vLLM's servers do; fields headrace cannot honour are refused by
``convert`` with a 400 naming them. Every integer is bounded by the range of the protobuf field
it becomes (``Int32``, ``TokenId``): a larger one (``max_tokens: 1e20``) is a 400 naming it,
never a 500 from the conversion. Types are strict, as JSON says them: a boolean where an integer
is expected (``"max_tokens": true``), a string for a number (``"n": "2"``) or for a boolean
(``"stream": "yes"``) is a 400 naming the field; an integral number written as a float (``2.0``)
is taken as the integer, an integer where a float is expected as that float."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _integral(value):
    """2.0 is the integer 2 (JSON has one number type); anything else goes to the strict check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
Int32 = Annotated[Int, Field(ge=-(1 << 31), lt=1 << 31)]
TokenId = Annotated[Int, Field(ge=0, lt=1 << 32)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int = Field(1, ge=1, lt=1 << 32)   # at most the server's --max-n (headrace.controlplane.requests.validation)
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=0, lt=1 << 64)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 = 0
    ignore_eos: bool = False
    priority: Int32 = 0
    stop_token_ids: list[TokenId] | None = None
    request_id: str | None = None
    # structured outputs (headrace.controlplane.http.structured): OpenAI's, and vLLM's current and older
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[Int], list[list[Int]]]   # ids: checked by ``convert``
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessageIn(_Body):
    model_config = ConfigDict(extra="allow")   # tool_calls, tool_call_id, reasoning_content, ...
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None   # false: tool_choice "required" makes one call
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int32]


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error",
                    "rate_limit_error", "server_error", "service_unavailable"]


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
