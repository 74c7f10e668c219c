"""OpenAI request models, and the usage/timings blocks of responses.

Requests validate strictly (no "0.5" for a float, no 1.0 for an int, no NaN) so that wrong
types are 400s, and ignore fields we do not know, as OpenAI clients send many. `null` always
means "absent".
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from engine.types import Stats
from server.errors import APIError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI spec's default for /v1/completions
MAX_CHOICES = 128  # n (times the number of prompts of a batched completion)
MAX_STOPS, MAX_STOP_CHARS = 128, 512  # bounds the per-token cost of stop-string matching
MAX_TOP_LOGPROBS, MAX_LEGACY_LOGPROBS = 20, 5
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")  # printed into <function=NAME>: no '>', '=', spaces


def _whole_number(value: Any) -> Any:
    """Clients written in JavaScript send 16.0 for 16 (JSON has one number type): a float with no
    fractional part counts as an integer; 1.5 stays a float and fails the integer check."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


WholeNumber = BeforeValidator(_whole_number)


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


def _tool_name(v: str) -> str:
    if not TOOL_NAME.match(v):
        raise ValueError("must be 1-128 characters of a-z, A-Z, 0-9, '_', '.', ':' or '-'")
    return v


class FunctionCall(StrictModel):
    """A call in an assistant message of the history; its name is printed into the prompt like a
    tool definition's, so it is held to the same rule."""

    name: str
    arguments: str | dict[str, Any] = ""

    _name = field_validator("name")(_tool_name)


class ToolCall(StrictModel):
    model_config = ConfigDict(strict=True, extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # legacy (before tools): the assistant's one call
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def template_dict(self) -> dict:
        """The message as chat templates know it: the legacy `function` role (a function's result)
        is a tool result, and a legacy `function_call` is a one-element tool_calls."""
        out = self.model_dump(exclude_none=True, exclude={"function_call"})
        out.setdefault("content", None)
        if self.role == "function":
            out["role"] = "tool"
        if self.function_call is not None and not self.tool_calls:
            out["tool_calls"] = [{"type": "function", "function": self.function_call.model_dump()}]
        return out


class FunctionDef(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (type "object")
    strict: bool | None = None

    _name = field_validator("name")(_tool_name)


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class LegacyFunctionChoice(StrictModel):
    """The legacy `function_call: {"name": ...}` (before tool_choice)."""

    name: str


class JSONSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """text | json_object (llama.cpp also takes a `schema` here) | json_schema {json_schema: {name, schema}}."""

    type: Literal["text", "json_object", "json_schema"]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _shape(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object: {\"name\": ..., \"schema\": {...}}")
        return self

    @property
    def output_schema(self) -> dict | None:
        if self.type == "json_schema":
            return self.json_schema.schema_ if self.json_schema is not None else None
        return self.schema_ if self.type == "json_object" else None


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class SpecRequest(StrictModel):
    """Extra body field `spec`: per-request speculation (engine.config.SpecConfig), as an object
    or as a bare method name (`"spec": "none"` turns speculation off for the request). The upper
    limits depend on the server's settings (server.planning.Planner.spec)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: Literal["none", "ngram", "draft", "draft-tree", "mtp", "dflash"]
    tree: Literal["chain", "ddtree", "weaver"] | None = None
    budget: Annotated[int, Field(ge=1)] | None = None
    max_depth: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _method_name(cls, value: Any) -> Any:
        return {"method": value} if isinstance(value, str) else value


NonNegInt = Annotated[int, WholeNumber, Field(ge=0)]
# -1 = no limit: generate until EOS or the context ends (llama.cpp's n_predict -1)
TokenLimit = Annotated[int, WholeNumber, Field(ge=-1)]
Seed = Annotated[int, WholeNumber, Field(ge=INT64_MIN, le=INT64_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class GenerationFields(StrictModel):
    """Fields shared by chat and legacy completions."""

    default_temperature: ClassVar[float] = 1.0  # OpenAI's default
    model: str | None = None  # any name is accepted: one model is served
    max_tokens: TokenLimit | None = None
    n_predict: TokenLimit | None = None  # llama.cpp's name; wins over max_tokens / max_completion_tokens
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # 0 = greedy (as vLLM)
    top_k: Annotated[int, WholeNumber, Field(ge=-1)] | None = None  # -1 and 0 both mean "off"
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, WholeNumber, Field(ge=1, le=MAX_CHOICES)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # token id -> bias
    user: str | None = None  # accepted and ignored
    ignore_eos: bool | None = None  # llama.cpp/SGLang extension: run to max_tokens (benchmarks)
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None  # vLLM / HF extension
    spec: SpecRequest | None = None

    @model_validator(mode="after")
    def _common(self):
        # Raised as APIError (not ValueError) so that the error names its field, not the whole body.
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        seen: dict[int, str] = {}
        for key in self.logit_bias or {}:
            if not key.isascii() or not key.isdigit() or len(key) > 9:
                raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            if int(key) in seen:
                raise APIError(f"logit_bias keys {seen[int(key)]!r} and {key!r} name the same token {int(key)}",
                               param="logit_bias")
            seen[int(key)] = key
        return self

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1


class ChatCompletionRequest(GenerationFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: TokenLimit | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[FunctionDef] | None = None  # legacy (before tools): mapped to tools
    function_call: Literal["none", "auto"] | LegacyFunctionChoice | None = None  # legacy tool_choice
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, WholeNumber, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None  # alias of chat_template_kwargs.enable_thinking
    # Any value the SDKs send ("minimal" ... "xhigh", "max", and whatever comes next): only "none"
    # changes anything here (thinking off); the others leave the template's default.
    reasoning_effort: Annotated[str, Field(max_length=64)] | None = None

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.functions is not None and self.tools is not None:
            raise APIError("send tools or the legacy functions, not both", param="functions")
        if self.function_call is not None and self.tool_choice is not None:
            raise APIError("send tool_choice or the legacy function_call, not both", param="function_call")
        if self.functions:  # legacy functions are tools; one call per answer, as the legacy API returned
            self.tools = [ToolDef(type="function", function=f) for f in self.functions]
            if self.parallel_tool_calls is None:
                self.parallel_tool_calls = False
        if isinstance(self.function_call, LegacyFunctionChoice):
            self.tool_choice = NamedToolChoice(type="function", function=NamedFunction(name=self.function_call.name))
        elif self.function_call is not None:
            self.tool_choice = self.function_call
        return self

    @property
    def legacy_functions(self) -> bool:
        """The request used `functions`: the answer says `function_call`, not `tool_calls`."""
        return self.functions is not None

    @property
    def requested_max_tokens(self) -> int | None:
        """n_predict, else max_completion_tokens, else max_tokens; None (or -1) = until EOS or the
        context ends (then the server's default limit applies)."""
        for value in (self.n_predict, self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return None if value < 0 else value
        return None

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def thinking(self) -> bool | None:
        """enable_thinking from chat_template_kwargs, the top-level alias, or reasoning_effort 'none'."""
        value = (self.chat_template_kwargs or {}).get("enable_thinking", self.enable_thinking)
        if value is not None and not isinstance(value, bool):
            raise APIError("chat_template_kwargs.enable_thinking must be a boolean",
                           param="chat_template_kwargs.enable_thinking")
        if value is None and self.reasoning_effort == "none":
            return False
        return value


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(GenerationFields):
    prompt: Prompt
    echo: bool | None = None
    suffix: str | None = None
    logprobs: Annotated[int, WholeNumber, Field(ge=0, le=MAX_LEGACY_LOGPROBS)] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        """n_predict, else max_tokens (-1: until EOS or the context ends), else OpenAI's default of 16."""
        value = self.n_predict if self.n_predict is not None else self.max_tokens
        if value is None:
            return COMPLETIONS_DEFAULT_MAX_TOKENS
        return None if value < 0 else value

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one, or a batch (each gets n choices)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for i, one in enumerate(batch):
            if len(one) == 0:
                raise APIError("prompt is empty" if len(batch) == 1 else f"prompt[{i}] is empty", param="prompt")
        if len(batch) * self.choices > MAX_CHOICES:
            raise APIError(f"{len(batch)} prompts x n={self.choices} choices is more than {MAX_CHOICES}",
                           param="prompt")
        return cast(list[str | list[int]], batch)  # validated above: strings or token-id lists


def usage_block(prompt_tokens: int, generated: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def timings_block(stats: Stats) -> dict:
    """llama.cpp's `timings` names, plus forward_passes / tokens_per_forward for speculation."""
    prompt_n = stats.prompt_tokens - stats.cached_tokens
    return {
        "cache_n": stats.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": round(stats.prompt_ms, 3),
        "prompt_per_token_ms": round(stats.prompt_ms / prompt_n, 3) if prompt_n else 0.0,
        "prompt_per_second": round(stats.prefill_tps, 3),
        "ttft_ms": round(stats.ttft_ms, 3),  # the request's start on the engine thread to its first token
        "predicted_n": stats.generated_tokens,
        "predicted_ms": round(stats.decode_ms, 3),
        "predicted_per_token_ms": round(stats.decode_ms / stats.generated_tokens, 3) if stats.generated_tokens
        else 0.0,
        "predicted_per_second": round(stats.decode_tps, 3),
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        # rounds whose accepted path reached depth 1, 2, ... (vLLM's per-position acceptance counters)
        "draft_n_accepted_per_pos": list(stats.accepted_per_pos),
        "forward_passes": stats.forward_passes,
        "tokens_per_forward": round(stats.tokens_per_forward, 4),
        "draft_ms": round(stats.draft_ms, 3),  # time per phase of the decode rounds
        "verify_ms": round(stats.verify_ms, 3),
        "commit_ms": round(stats.commit_ms, 3),
    }
