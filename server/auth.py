"""Optional API key: every route but /health needs `Authorization: Bearer KEY` (or `x-api-key: KEY`).

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer streamed
responses and hide client disconnects from the routes).
"""

from __future__ import annotations

import hmac

from server.errors import APIError
from server.http_guards import send_error

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


class APIKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = APIError("invalid or missing API key: send the header 'Authorization: Bearer <key>'", status=401,
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await send_error(send, err)

    def _authorized(self, scope) -> bool:
        token = None
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                token = value[7:].strip()
            elif name == b"x-api-key" and token is None:
                token = value.strip()
        return token is not None and hmac.compare_digest(token, self._key)
