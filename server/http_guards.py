"""What keeps web pages away from a local server: the Host check (DNS rebinding), the JSON-only
Content-Type on POST (no "simple" cross-site request can start a generation), and CORS refusals
in the OpenAI error shape. Plain ASGI middlewares, like the API-key check (Starlette's
BaseHTTPMiddleware would buffer streamed responses).

Why these two checks: a page on any site may POST to http://127.0.0.1:8000 without asking the
browser's permission (a CORS preflight) as long as the Content-Type is text/plain, a form type or
absent; requiring application/json forces the preflight, which a server without --cors-origin
refuses. And a page on a domain its owner points at 127.0.0.1 (DNS rebinding) is same-origin with
the server, so the browser lets it read every answer; such a request carries the attacker's
domain name in its Host header, which no legitimate client of a local server sends.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from server.errors import APIError

HEALTH_PATHS = frozenset({"/health", "/v1/health"})
LOOPBACK_NAMES = frozenset({"localhost"})


async def send_error(send, err: APIError, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer an HTTP request with err as JSON from inside an ASGI middleware."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers, *((k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def host_name(host_header: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostGuard:
    """Refuses (403) requests whose Host names a domain this server was not told about.

    Always allowed: IP literals (a rebinding attack needs a domain name), localhost and
    *.localhost, and the names in `allowed` (spruce serve --allowed-host, and the --host name).
    /health stays open to everyone, as it is for the API key.
    """

    def __init__(self, app, allowed: tuple[str, ...] = ()) -> None:
        self.app = app
        self.allowed = frozenset(name.lower().rstrip(".") for name in allowed)

    def allows(self, host_header: str | None) -> bool:
        if not host_header:  # HTTP/1.0 clients; every browser sends Host
            return True
        name = host_name(host_header).rstrip(".")
        return (is_ip_literal(name) or name in LOOPBACK_NAMES or name.endswith(".localhost")
                or name in self.allowed)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in HEALTH_PATHS:
            await self.app(scope, receive, send)
            return
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        if self.allows(host):
            await self.app(scope, receive, send)
            return
        await send_error(send, APIError(
            f"Host {host!r} is not allowed: this server answers to localhost and IP addresses. To reach it "
            "under this name, start it with --allowed-host NAME (or --allow-any-host).", status=403,
            code="host_not_allowed"))


def is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class JSONContentTypeGuard:
    """POST bodies must be declared JSON (415 otherwise)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            declared = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"), "")
            if not is_json_type(declared):
                await send_error(send, APIError(
                    f"Content-Type must be application/json, got {declared or 'none'!r} "
                    "(curl: add -H 'Content-Type: application/json')", status=415, code="unsupported_media_type"))
                return
        await self.app(scope, receive, send)


class JSONCORSMiddleware(CORSMiddleware):
    """Starlette's CORS middleware, with refused preflights answered in the OpenAI error shape."""

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        headers = {k: v for k, v in response.headers.items() if k not in ("content-type", "content-length")}
        message = bytes(response.body).decode("utf-8", "replace")
        err = APIError(f"CORS preflight refused: {message}", status=response.status_code, code="cors_refused")
        return JSONResponse(err.body(), status_code=response.status_code, headers=headers)
