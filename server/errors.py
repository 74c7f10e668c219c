"""The OpenAI error shape, and body bytes -> a validated request model (every failure a 400).

Nothing a client sends may surface as a 500: bodies too deep for the JSON parser, integers too
long for Python's int parser, lone UTF-16 surrogates (which cannot be re-encoded as UTF-8 on the
way out) and wrong types all become APIError(400) here, before any work is queued.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

# The `type` of an error body by HTTP status (OpenAI's names; llama.cpp's for 401 and 503).
STATUS_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
                503: "unavailable_error"}


class APIError(Exception):
    """An error that leaves the server as {"error": {...}} with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str | None = None,
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        if type is None:
            type = STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_json(raw: bytes) -> Any:
    """Body bytes -> a JSON value, whatever the Content-Type (curl -d sends a form type)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError("request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, or an integer with > 4300 digits
        raise APIError(f"request body is not valid JSON: {e}") from None
    if b"\\ud" in raw or b"\\uD" in raw:  # only a \u escape can spell a surrogate (UTF-8 bytes cannot)
        _check_encodable(data)
    return data


def _check_encodable(data: Any) -> None:
    """JSON may spell lone surrogates ("\\ud800"); such text cannot be tokenized or sent back."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise APIError("request body is nested too deeply") from None
    except UnicodeEncodeError:
        raise APIError("request body contains a lone UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode") from None


def parse_request(raw: bytes, model: type[BaseModel]):
    """Body bytes -> request model."""
    return validate(parse_json(raw), model)


def validate(data: Any, model: type[BaseModel]):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise APIError("request body is nested too deeply") from None


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
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|constrained-\w+|function-.*|[a-z]+\[.*\]|[A-Z]\w*|literal\[.*\])$")


def _format_loc(loc) -> str | None:
    out = ""
    for part in loc:
        if part == "body" or (isinstance(part, str) and _UNION_TAG.match(part)):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None
