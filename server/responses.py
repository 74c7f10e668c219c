"""/v1/responses (OpenAI's Responses API): requests become chat requests, answers become output items.

A request is turned into a ChatCompletionRequest (instructions -> a system message, input items ->
messages, function_call / function_call_output items -> tool calls and tool results,
`previous_response_id` -> the stored conversation first), planned and run like a chat completion,
and its reasoning, text and tool calls come back as `reasoning`, `message` and `function_call`
output items (server/responses_output.py). Responses are kept in memory (the newest
RESPONSES_KEPT, unless `store: false`) so that a later request can continue from them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import Field

from server.errors import APIError
from server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    JSONSchemaFormat,
    Penalty,
    ResponseFormat,
    Seed,
    SpecRequest,
    StopString,
    StrictModel,
    TokenLimit,
    WholeNumber,
)

RESPONSES_KEPT = 256


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(StrictModel):
    format: TextFormat | None = None


class ReasoningOptions(StrictModel):
    effort: Annotated[str, Field(max_length=64)] | None = None


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: TokenLimit | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, WholeNumber, Field(ge=-1)] | None = None
    seed: Seed | None = None
    stop: StopString | list[StopString] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    spec: SpecRequest | None = None


class ResponseStore:
    """The conversations of recent responses, by id (least recently stored first out)."""

    def __init__(self, capacity: int = RESPONSES_KEPT) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, response_id: str) -> list[dict]:
        with self._lock:
            messages = self._items.get(response_id)
        if messages is None:
            raise APIError(f"previous_response_id {response_id!r} is not a response this server keeps (it keeps "
                           f"the newest {self.capacity} in memory, and none across restarts)",
                           param="previous_response_id", code="previous_response_not_found")
        return messages

    def put(self, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            self._items[response_id] = messages
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)


def chat_request(body: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request this Responses request runs as, and its messages (stored with the answer)."""
    messages = list(history)
    if body.instructions:  # instructions are not carried over from a previous response
        messages = [m for m in messages if m.get("role") != "system"]
        messages.insert(0, {"role": "system", "content": body.instructions})
    messages += input_messages(body.input)
    chat: dict[str, Any] = {
        "messages": messages, "model": body.model, "temperature": body.temperature, "top_p": body.top_p,
        "top_k": body.top_k, "seed": body.seed, "stop": body.stop, "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty, "max_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls, "chat_template_kwargs": body.chat_template_kwargs,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
    }
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in body.tools]
    if isinstance(body.tool_choice, NamedFunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text else None
    if fmt is not None:
        chat["response_format"] = response_format(fmt)
    try:
        request = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValueError as e:
        raise APIError(f"input: {e}", param="input") from None
    if body.spec is not None:
        request.spec = body.spec
    return request, messages


def response_format(fmt: TextFormat) -> ResponseFormat:
    if fmt.type != "json_schema":
        return ResponseFormat(type=fmt.type)
    if fmt.schema_ is None:
        raise APIError("text.format of type json_schema needs a schema", param="text.format.schema")
    return ResponseFormat(type="json_schema",
                          json_schema=JSONSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict))


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """Responses input -> chat messages (validated later as ChatMessage)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(f"input[{i}] must be an object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _content(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if out and out[-1].get("role") == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _content(output, f"input[{i}].output") if not isinstance(output, str) else output})
        elif kind == "reasoning":
            continue  # earlier reasoning: the chat template drops it from past turns anyway
        else:
            raise APIError(f"input[{i}].type {kind!r} is not supported here (message, function_call, "
                           "function_call_output, reasoning)", param=f"input[{i}].type")
    return out


def _content(content: Any, param: str) -> Any:
    """Text parts (input_text, output_text) -> one string; other parts are refused."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{param} must be a string or a list of parts", param=param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(f"{param}[{j}]: only text parts are supported by this text model, got {kind!r}",
                           param=f"{param}[{j}]")
        text = part.get("text")
        if not isinstance(text, str):
            raise APIError(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
        texts.append(text)
    return "".join(texts)


def assistant_message(reasoning: str, content: str, calls: list[dict]) -> dict:
    """The answer as a chat message, for the store (the next turn re-renders it)."""
    message: dict = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    ChatMessage.model_validate(message)  # what the store holds must render next time
    return message


def response_base(body: ResponsesRequest, response_id: str, model: str, created: float) -> dict:
    """The fields of a Response object that echo the request."""
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
              "strict": t.strict} for t in body.tools or []]
    choice: Any = body.tool_choice or "auto"
    if isinstance(choice, NamedFunctionChoice):
        choice = {"type": "function", "name": choice.name}
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else \
        {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created, "status": "in_progress", "model": model,
        "output": [], "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": choice, "tools": tools, "text": {"format": fmt}, "store": body.store is not False,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
    }


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def now() -> float:
    return float(int(time.time()))
