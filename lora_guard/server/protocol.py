"""Request bodies, as TGI and OpenAI define them. Unknown fields are ignored, as TGI does."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    # Unknown fields are ignored, as TGI does; NaN and Infinity (which Python's JSON reader takes)
    # are not numbers a request may carry.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class GenerateParameters(_Body):
    adapter_id: str | None = None
    best_of: int | None = None
    decoder_input_details: bool = False
    details: bool = True
    do_sample: bool = False
    frequency_penalty: float | None = None
    grammar: Any = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    return_full_text: bool | None = None
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    temperature: float | None = None
    top_k: int | None = None
    top_n_tokens: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False


class GenerateRequest(_Body):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class TokenizeRequest(_Body):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class PromptTokenizeRequest(_Body):
    """vLLM's ``/tokenize`` body for a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTokenizeRequest(_Body):
    """vLLM's ``/tokenize`` body for chat messages (through the chat template)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """vLLM's ``/detokenize`` body."""

    model: str | None = None
    tokens: list[int]


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with ``usage`` and no choices
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the counts so far


class _OpenAIBody(_Body):
    """OpenAI's fields, and vLLM's sampling extras where the engine has them. Other fields are
    kept (not refused, as OpenAI does) so that the route can log them once."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    top_k: int | None = None  # vLLM's -1 and 0: no top-k
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True


class _Sampled(BaseModel):
    """The sampling fields both OpenAI routes take, after the route's own model and input (a
    mixin: a request's fields come in the order its schema shows)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class _Chat(_OpenAIBody):
    model: str | None = None
    messages: list[ChatMessage]


class ChatCompletionRequest(_Sampled, _Chat):
    max_completion_tokens: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    n: int | None = None


class _Completion(_OpenAIBody):
    model: str | None = None
    prompt: str | list[str]


class CompletionRequest(_Sampled, _Completion):
    echo: bool = False
    n: int | None = None
