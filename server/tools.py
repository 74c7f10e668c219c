"""Tools: the request's tool list and tool_choice, and the Qwen3.5 XML tool-call format.

A call looks like (the format the Qwen3.5 chat template teaches the model):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Each VALUE becomes a JSON value: by the tool's JSON schema type for KEY where given (a "string"
parameter stays text even when it looks like a number), else parsed as JSON where it parses, else
kept as text. The older JSON body ({"name": ..., "arguments": {...}}, Qwen3 / Hermes) is read too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from server.errors import APIError
from server.schemas import ChatCompletionRequest, NamedToolChoice

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN = re.compile(r"<function=([^>\n]+)>")
PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]+)>")
PARAMETER_CLOSE, FUNCTION_CLOSE = "</parameter>", "</function>"


@dataclass(frozen=True)
class ToolSet:
    """The tools a request enables: name -> {parameter -> allowed JSON types} (empty = unknown)."""

    param_types: dict[str, dict[str, tuple[str, ...]]]
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    def types_of(self, function: str, key: str) -> tuple[str, ...]:
        return self.param_types.get(function, {}).get(key, ())


def tool_set(body: ChatCompletionRequest) -> ToolSet | None:
    """None when tool calls are off (no tools, or tool_choice "none"); 400 on inconsistent choices.
    Names and arguments are enforced while decoding (server/structured.py)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs a non-empty tools list", param="tool_choice")
        return None
    if choice == "none":
        return None
    types = {tool.function.name: _param_types(tool.function.parameters or {}) for tool in body.tools}
    if isinstance(choice, NamedToolChoice) and choice.function.name not in types:
        raise APIError(f"tool_choice names {choice.function.name!r}, which is not in tools",
                       param="tool_choice.function.name")
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) != len(names):
        raise APIError("tools has two functions of one name", param="tools")
    return ToolSet(types, body.parallel_tool_calls is not False)


def _param_types(schema: dict) -> dict[str, tuple[str, ...]]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    out = {}
    for key, sub in (props or {}).items():
        t = sub.get("type") if isinstance(sub, dict) else None
        listed = tuple(x for x in (t if isinstance(t, list) else [t]) if isinstance(x, str))
        if not listed and isinstance(sub, dict) and "enum" in sub:
            listed = ("enum",)
        out[key] = listed
    return out


def convert_value(raw: str, types: tuple[str, ...]) -> Any:
    """A parameter's text -> its JSON value (see the module note)."""
    if types == ("string",):
        return raw
    value = _json_value(raw)
    if value is _NOT_JSON and "boolean" in types:
        value = _bool_value(raw)  # "True" / "FALSE"
    if value is _NOT_JSON:
        return raw
    if "string" in types and "enum" not in types and not _fits(value, types):
        return raw  # e.g. "007" for a string-or-null parameter stays text
    return value


_NOT_JSON = object()


def _json_value(raw: str) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _bool_value(raw: str) -> Any:
    return {"true": True, "false": False}.get(raw.strip().lower(), _NOT_JSON)


def _fits(value: Any, types: tuple[str, ...]) -> bool:
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    for t in types:
        if t in ("number", "integer") and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t in kinds and isinstance(value, kinds[t]):
            return True
    return False


def _reject(name: str):
    raise ValueError(name)


def parse_json_call(body: str) -> tuple[str, dict] | None:
    """The Qwen3 / Hermes JSON body {"name": ..., "arguments": {...}} -> (name, arguments)."""
    try:
        data = json.loads(body, parse_constant=_reject)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        args = _json_value(args)
    return (data["name"], args) if isinstance(args, dict) else None


def strip_value(text: str) -> str:
    """The template writes each value between newlines: '<parameter=k>\\nVALUE\\n</parameter>'."""
    return text.removeprefix("\n").removesuffix("\n")
