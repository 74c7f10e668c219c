"""API key, CORS, body size limit and the server-wide token cap: apps over the shared engine."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from server.app import create_app
from server.cli import build_parser, server_options
from server.planning import ServerOptions

MSG = [{"role": "user", "content": "hi"}]


def call(live_server, options: ServerOptions, method: str, path: str, **kw) -> httpx.Response:
    """One request to a fresh app (in-process ASGI) over the live server's engine thread."""
    app = create_app(live_server.bridge, options)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return await client.request(method, path, timeout=60, **kw)

    return asyncio.run(go())


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"


@pytest.mark.parametrize("path,method", [("/v1/models", "GET"), ("/v1/chat/completions", "POST"), ("/infill", "POST"),
                                         ("/tokenize", "POST"), ("/v1/nope", "GET"), ("/props", "GET")])
def test_every_route_but_health_needs_the_key(live_server, path, method):
    opts = ServerOptions(api_key="sekret")
    body = {"json": {"messages": MSG, "max_tokens": 1}} if method == "POST" else {}
    assert_401(call(live_server, opts, method, path, **body))
    assert_401(call(live_server, opts, method, path, headers={"Authorization": "Bearer wrong"}, **body))
    assert_401(call(live_server, opts, method, path, headers={"Authorization": "sekret"}, **body))
    ok = call(live_server, opts, method, path, headers={"Authorization": "Bearer sekret"}, **body)
    assert ok.status_code != 401
    assert call(live_server, opts, method, path, headers={"x-api-key": "sekret"}, **body).status_code == ok.status_code


def test_health_is_public(live_server):
    for path in ("/health", "/v1/health"):
        assert call(live_server, ServerOptions(api_key="k"), "GET", path).status_code == 200


def test_sdk_with_a_key(live_server):
    """The official client sends the key as a Bearer token; a wrong one is AuthenticationError."""
    app = create_app(live_server.bridge, ServerOptions(api_key="k"))

    async def go(key: str):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost/v1") as http:
            client = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key=key, http_client=http, max_retries=0)
            return await client.chat.completions.create(model="m", messages=MSG, max_tokens=2)

    assert asyncio.run(go("k")).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(go("nope"))


def test_cors_is_off_unless_an_origin_is_given(live_server):
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = call(live_server, ServerOptions(), "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    r = call(live_server, ServerOptions(), "GET", "/v1/models", headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in r.headers
    opts = ServerOptions(api_key="k", cors_origins=("http://app.example",))
    r = call(live_server, opts, "OPTIONS", "/v1/chat/completions", headers=preflight)  # answered before the key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = call(live_server, opts, "GET", "/v1/models", headers={"Origin": "http://app.example",
                                                               "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = call(live_server, opts, "GET", "/v1/models", headers={"Origin": "http://evil.example",
                                                               "Authorization": "Bearer k"})
    assert "access-control-allow-origin" not in r.headers


def test_body_size_limit_is_413(live_server):
    opts = ServerOptions(max_body_bytes=1000)
    r = call(live_server, opts, "POST", "/v1/completions", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = call(live_server, opts, "POST", "/v1/completions", json={"prompt": "x" * 10, "max_tokens": 1})
    assert r.status_code == 200


def test_server_token_cap(live_server):
    opts = ServerOptions(max_tokens_cap=3)
    r = call(live_server, opts, "POST", "/v1/chat/completions",
             json={"messages": MSG, "max_tokens": 50, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"


def test_cli_options(monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.delenv("SPRUCE_API_KEY", raising=False)
    assert server_options(parse(["serve"])) == ServerOptions()
    monkeypatch.setenv("SPRUCE_API_KEY", "from-env")
    assert server_options(parse(["serve"])).api_key == "from-env"
    assert server_options(parse(["serve", "--api-key", "flag"])).api_key == "flag"
    opts = server_options(parse(["serve", "--cors-origin", "http://a", "--cors-origin", "http://b", "--max-tokens",
                                 "64"]))
    assert opts.cors_origins == ("http://a", "http://b") and opts.max_tokens_cap == 64
    assert parse(["serve"]).host == "127.0.0.1"
