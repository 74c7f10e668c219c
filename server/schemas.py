"""OpenAI request models, the error shape, and the usage/timings blocks of responses.

Requests validate strictly (no "0.5" for a float, no 1.0 for an int) so that wrong types
are 400s, and ignore fields we do not know, as OpenAI clients send many. `null` always
means "absent".
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.types import Stats

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI spec's default for /v1/completions


class APIError(Exception):
    """An error that leaves the server as {"error": {...}} with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_request(raw: bytes, model: type[BaseModel]):
    """Body bytes -> request model, whatever the Content-Type (curl -d sends a form type)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"request body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(exc: RequestValidationError | ValidationError) -> APIError:
    """pydantic / FastAPI validation errors -> one 400 listing every problem with its field path."""
    by_param: dict[str | None, list[str]] = {}
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # loc is a character offset here, not a field
            return APIError(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
        msgs = by_param.setdefault(_format_loc(err.get("loc", ())), [])
        if err["msg"] not in msgs:
            msgs.append(err["msg"])
    problems = [f"{param or 'body'}: {' or '.join(msgs)}" for param, msgs in by_param.items()]
    # The deepest path names the real culprit when a union member got further than the others.
    param = max(by_param, key=lambda p: len(p or ""), default=None)
    return APIError("; ".join(problems) or "invalid request", param=param)


# pydantic names the member of a union it tried ("str", "list[TextPart]", "TextPart") in the error path.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|function-.*|[a-z]+\[.*\]|[A-Z]\w*)$")


def _format_loc(loc) -> str | None:
    out = ""
    for part in loc:
        if part == "body" or (isinstance(part, str) and _UNION_TAG.match(part)):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Model):
    model_config = ConfigDict(strict=True, extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def template_dict(self) -> dict:
        out = self.model_dump(exclude_none=True)
        out.setdefault("content", None)
        return out


class StreamOptions(_Model):
    include_usage: bool | None = None


class SpecRequest(_Model):
    """Extra body field `spec`: per-request speculation (engine.config.SpecConfig)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: Literal["none", "ngram", "draft"]
    budget: Annotated[int, Field(ge=1, le=4096)] | None = None
    max_depth: Annotated[int, Field(ge=1, le=1024)] | None = None


NonNegInt = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class GenerationFields(_Model):
    """Fields shared by chat and legacy completions."""

    model: str | None = None
    max_tokens: NonNegInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 and 0 both mean "off"
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None  # accepted, not applied yet
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None  # accepted, not applied yet
    ignore_eos: bool | None = None  # llama.cpp/SGLang extension: run to max_tokens (benchmarks)
    spec: SpecRequest | None = None

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: NonNegInt | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens overrides max_tokens; None = until EOS or the context ends."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None

    @property
    def requested_max_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch of one is unwrapped; larger batches are refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(f"batched prompts are not supported (got {len(p)}); send one prompt per request",
                               param="prompt")
            p = p[0]
        if isinstance(p, (str, list)) and len(p) == 0:
            raise APIError("prompt is empty", param="prompt")
        return p


def usage_block(prompt_tokens: int, stats: Stats) -> dict:
    completion = stats.generated_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def timings_block(stats: Stats) -> dict:
    """llama.cpp's `timings` names, plus tokens_per_forward for speculation."""
    return {
        "cache_n": stats.cached_tokens,
        "prompt_n": stats.prompt_tokens - stats.cached_tokens,
        "prompt_ms": round(stats.prompt_ms, 3),
        "prompt_per_second": round(stats.prefill_tps, 3),
        "predicted_n": stats.generated_tokens,
        "predicted_ms": round(stats.decode_ms, 3),
        "predicted_per_second": round(stats.decode_tps, 3),
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "forward_passes": stats.forward_passes,
        "tokens_per_forward": round(stats.tokens_per_forward, 4),
    }
