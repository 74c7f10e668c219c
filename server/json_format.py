"""response_format: check the request's JSON schema, and check the model's answer against it.

The engine has no constrained decoding yet, so JSON output is not guaranteed: the server checks
the finished answer instead (a subset of JSON Schema: type, properties, required, items, enum,
additionalProperties: false) and reports what is wrong in the response (`json_error`, an extension
field). An answer wrapped in one Markdown code fence is unwrapped when its inside is valid.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.errors import APIError

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_FENCE = re.compile(r"^\s*```[A-Za-z]*\n(.*?)\n?```\s*$", re.DOTALL)
MAX_SCHEMA_DEPTH = 64


def check_schema(schema: Any, param: str, depth: int = 0) -> None:
    """Raise APIError(400) when `schema` is not a usable JSON schema (the parts we read)."""
    if depth > MAX_SCHEMA_DEPTH:
        raise APIError("JSON schema is nested too deeply", param=param)
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise APIError(f"{param}: a JSON schema must be an object or a boolean", param=param)
    types = schema.get("type")
    if types is not None:
        listed = types if isinstance(types, list) else [types]
        bad = [t for t in listed if t not in JSON_TYPES]
        if bad or not listed:
            raise APIError(f"{param}.type: {bad[0] if bad else types!r} is not a JSON schema type {JSON_TYPES}",
                           param=f"{param}.type")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise APIError(f"{param}.properties must be an object", param=f"{param}.properties")
        for name, sub in props.items():
            check_schema(sub, f"{param}.properties.{name}", depth + 1)
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise APIError(f"{param}.required must be a list of strings", param=f"{param}.required")
    items = schema.get("items")
    if items is not None:
        check_schema(items, f"{param}.items", depth + 1)
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise APIError(f"{param}.enum must be a list", param=f"{param}.enum")


def parse_answer(text: str) -> tuple[Any, str]:
    """-> (the JSON value, the JSON text) of an answer, unwrapping one code fence; ValueError if none."""
    for candidate in (text, *(m.group(1) for m in [_FENCE.match(text)] if m)):
        try:
            return json.loads(candidate, parse_constant=_no_constant), candidate.strip()
        except (ValueError, RecursionError):
            continue
    raise ValueError("the answer is not valid JSON")


def answer_problem(value: Any, schema: Any, path: str = "$", depth: int = 0) -> str | None:
    """The first way `value` breaks `schema` (the subset above), or None."""
    if schema is True or schema is None or depth > MAX_SCHEMA_DEPTH:
        return None
    if schema is False:
        return f"{path}: no value is allowed here"
    types = schema.get("type")
    if types is not None and not any(_is_type(value, t) for t in (types if isinstance(types, list) else [types])):
        return f"{path}: expected {types}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {value!r} is not one of {schema['enum']}"
    if isinstance(value, dict):
        return _object_problem(value, schema, path, depth)
    if isinstance(value, list) and isinstance(schema.get("items"), (dict, bool)):
        for i, item in enumerate(value):
            if problem := answer_problem(item, schema["items"], f"{path}[{i}]", depth + 1):
                return problem
    return None


def _object_problem(value: dict, schema: dict, path: str, depth: int) -> str | None:
    props = schema.get("properties") or {}
    missing = [k for k in schema.get("required") or [] if k not in value]
    if missing:
        return f"{path}: missing required {missing}"
    if schema.get("additionalProperties") is False and (extra := [k for k in value if k not in props]):
        return f"{path}: properties {extra} are not allowed"
    for key, sub in props.items():
        if key in value and (problem := answer_problem(value[key], sub, f"{path}.{key}", depth + 1)):
            return problem
    return None


def _is_type(value: Any, t: str) -> bool:
    if t == "integer":
        whole_float = isinstance(value, float) and value.is_integer()
        return isinstance(value, int) and not isinstance(value, bool) or whole_float
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"object": dict, "array": list, "string": str, "boolean": bool,
                              "null": type(None)}.get(t, object))


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")
