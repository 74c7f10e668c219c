"""Bad input -> HTTP 400 (404 for unknown routes) with the OpenAI error body; never a 500."""

from __future__ import annotations

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def post(live_server, path: str, body) -> httpx.Response:
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    return httpx.post(live_server.base_url + path, headers={"content-type": "application/json"}, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param
    return err


BAD_CHAT = [
    ("{not json", None),
    ('{"messages": ', None),
    ({}, "messages"),
    ({"messages": None}, "messages"),
    ({"messages": "string"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [123]}, "messages[0]"),
    ({"messages": [{}]}, "messages[0].role"),
    ({"messages": [{"role": 123}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 123}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": MSG, "max_tokens": -2}, "max_tokens"),
    ({"messages": MSG, "max_tokens": "10"}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 1.5}, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"messages": MSG, "temperature": 2.5}, "temperature"),
    ({"messages": MSG, "temperature": -0.1}, "temperature"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "top_p": -0.1}, "top_p"),
    ({"messages": MSG, "top_p": 1.5}, "top_p"),
    ({"messages": MSG, "top_k": -2}, "top_k"),
    ({"messages": MSG, "min_p": 2}, "min_p"),
    ({"messages": MSG, "seed": 2**70}, "seed"),
    ({"messages": MSG, "stop": 5}, "stop"),
    ({"messages": MSG, "stop": ["a", 5]}, "stop[1]"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "n": 129}, "n"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "spec": {"method": "magic"}}, "spec.method"),
    ({"messages": MSG, "spec": {"method": "ngram", "budget": 0}}, "spec.budget"),
    ({"messages": MSG, "spec": {"method": "ngram", "depth": 3}}, "spec.depth"),
    ({"messages": MSG, "spec": {"method": "draft"}}, "spec.method"),
    ({"messages": MSG, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT)
def test_bad_chat_requests_are_400(live_server, body, param):
    assert_error(post(live_server, CHAT, body), 400, param)


BAD_COMPLETIONS = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": ["a"] * 65, "n": 2}, "prompt"),
    ({"prompt": [1, -3]}, "prompt"),
    ({"prompt": [1, 10**6]}, "prompt"),
    ({"prompt": [1, 2], "suffix": "b"}, "prompt"),
    ({"prompt": "a", "logprobs": 6}, "logprobs"),
    ({"prompt": "a", "max_tokens": -2}, "max_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(live_server, body, param):
    assert_error(post(live_server, COMPLETIONS, body), 400, param)


def test_post_bodies_must_be_declared_json(live_server):
    """A web page can send text/plain, form types or no type without a CORS preflight; only JSON
    starts work (curl -d needs -H 'Content-Type: application/json')."""
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    for content_type in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x", None):
        headers = {"content-type": content_type} if content_type else {}
        r = httpx.post(live_server.base_url + CHAT, content=body, headers=headers, timeout=60)
        err = assert_error(r, 415)
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = httpx.post(live_server.base_url + CHAT, content=body, headers={"content-type": content_type}, timeout=60)
        assert r.status_code == 200, r.text
    assert_error(post(live_server, CHAT, ""), 400)


def test_prompt_longer_than_context_names_the_lengths(live_server):
    max_context = live_server.bridge.engine.config.max_context
    for path, body in ((COMPLETIONS, {"prompt": "word " * 5000}),
                       (CHAT, {"messages": [{"role": "user", "content": "word " * 5000}], "stream": True})):
        err = assert_error(post(live_server, path, body), 400)
        assert err["code"] == "context_length_exceeded"
        assert str(max_context) in err["message"]
        n = len(live_server.bridge.engine.tokenizer.encode("word " * 5000))
        assert str(n) in err["message"] or path == CHAT


def test_unknown_route_and_method_use_the_error_shape(live_server):
    assert_error(httpx.get(live_server.base_url + "/v1/nope"), 404)
    assert_error(httpx.post(live_server.base_url + "/v2/chat/completions", json={}), 404)
    assert_error(httpx.get(live_server.base_url + CHAT), 405)


def test_sdk_raises_bad_request(live_server):
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSG, temperature=5)
    assert e.value.param == "temperature"


def test_server_still_serves_after_errors(live_server):
    r = post(live_server, CHAT, {"messages": MSG, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert live_server.bridge.alive
