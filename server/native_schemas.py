"""Request models of llama.cpp's native routes: /infill, /completion, /tokenize, /detokenize.

Field names and defaults follow llama.cpp's server (what llama.vim, llama.vscode, Continue's and
Tabby's llama.cpp providers send). Options we have no use for (samplers, cache_prompt, id_slot,
t_max_prompt_ms, ...) are accepted and ignored, as unknown fields are.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from server.errors import APIError
from server.schemas import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOPS,
    ChatMessage,
    Penalty,
    SpecRequest,
    StopString,
    StrictModel,
    TokenLimit,
    WholeNumber,
)

MAX_N_CMPL = 8
RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama.cpp's "pick a random seed"


class NativeFields(StrictModel):
    """llama.cpp's generation options (server-task.cpp params_from_json_cmpl), the ones we apply."""

    default_temperature: ClassVar[float] = 0.8  # llama.cpp's default
    include_usage: ClassVar[bool] = False  # no OpenAI usage chunk in llama.cpp's stream
    n_predict: TokenLimit | None = None  # -1 = until EOS / context end; 0 = prompt only
    max_tokens: TokenLimit | None = None  # alias; n_predict wins
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_k: Annotated[int, WholeNumber, Field(ge=-1)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # 0 = greedy
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, WholeNumber, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    ignore_eos: bool | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None  # llama.cpp's repetition penalty
    n_cmpl: Annotated[int, WholeNumber, Field(ge=1, le=MAX_N_CMPL)] | None = None  # llama.vscode asks for several
    n_indent: Annotated[int, WholeNumber, Field(ge=0)] | None = None
    t_max_predict_ms: Annotated[float, Field(ge=0)] | None = None
    response_fields: list[str] | None = None
    spec: SpecRequest | None = None

    @field_validator("seed")
    @classmethod
    def _random_seed(cls, v: int | None) -> int | None:
        return None if v in RANDOM_SEEDS else v

    @property
    def requested_max_tokens(self) -> int | None:
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        return None if n is None or n < 0 else n

    @property
    def repetition_penalty(self) -> float | None:
        return self.repeat_penalty

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def choices(self) -> int:
        return self.n_cmpl or 1


class ExtraContext(StrictModel):
    """One chunk of project context (llama.vim's ring buffer): prepended before the FIM prompt."""

    text: str
    filename: str = "tmp"


class InfillRequest(NativeFields):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraContext] = Field(default_factory=list)
    prompt: str = ""  # text after <|fim_middle|>: the start of the middle, already typed


class NativeCompletionRequest(NativeFields):
    prompt: str | Annotated[list[int], Field(min_length=1)]

    @model_validator(mode="after")
    def _non_empty(self) -> NativeCompletionRequest:
        if self.prompt == "":
            raise APIError("prompt is empty", param="prompt")
        return self


class TokenizeRequest(StrictModel):
    """llama.cpp: {content, add_special, parse_special, with_pieces}; vLLM: {prompt} or {messages}.
    parse_special (default true) reads special tokens spelled out in content / prompt as tokens."""

    content: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special: bool | None = None
    parse_special: bool | None = None
    with_pieces: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [k for k in ("content", "prompt", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise APIError("send exactly one of content, prompt or messages", param="content")
        if self.parse_special is not None and self.messages is not None:
            raise APIError("parse_special applies to content or prompt; in messages, special tokens typed in the "
                           "text always stay text", param="parse_special")
        return self


class DetokenizeRequest(StrictModel):
    tokens: list[Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]]
