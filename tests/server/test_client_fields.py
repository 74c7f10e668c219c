"""What real clients send: llama.vscode's max_tokens -1, n_predict on the OpenAI routes, whole floats,
top_p 0, every reasoning_effort, the legacy functions API, model names, the server's default
limit, the checkpoint's sampling defaults, and stop strings that wait for the reasoning to end."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.sampling_defaults import SamplingDefaults
from engine.types import Stats, Step
from server.app import create_app
from server.planning import DEFAULT_MAX_TOKENS, Planner, ServerOptions
from server.schemas import ChatCompletionRequest
from server.streaming import TextAssembler
from tests.server.scripted import scripted_output
from tests.server.test_errors import post

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def capped(live_server):
    """The live engine behind an app started as `spruce serve --max-tokens 5 --served-model-name coder`."""
    app = create_app(live_server.bridge, ServerOptions(max_tokens_cap=5, served_model_name="coder"))
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=120)

    def call(method: str, path: str, body: dict | None = None) -> httpx.Response:
        kwargs = {"content": json.dumps(body), "headers": {"content-type": "application/json"}} if body else {}
        return loop.run_until_complete(client.request(method, path, **kwargs))

    yield call
    loop.run_until_complete(client.aclose())
    loop.close()


def tokens_of(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


def test_server_limit_is_the_default_and_the_cap(capped):
    assert tokens_of(capped("POST", CHAT, {"messages": MSG, "ignore_eos": True})) == 5  # Continue sends no limit
    assert tokens_of(capped("POST", CHAT, {"messages": MSG, "ignore_eos": True, "max_tokens": -1})) == 5
    assert tokens_of(capped("POST", CHAT, {"messages": MSG, "ignore_eos": True, "max_tokens": 3})) == 3
    assert capped("GET", "/props").json()["default_generation_settings"]["params"]["n_predict"] == 5


def test_requests_without_a_limit_get_the_default(live_server):
    planner = Planner(live_server.bridge.engine, ServerOptions())
    context = live_server.bridge.engine.config.max_context
    assert planner.token_limit([1] * 10, None, "messages") == min(DEFAULT_MAX_TOKENS, context - 10)
    assert planner.token_limit([1] * 10, 7, "messages") == 7
    props = httpx.get(live_server.base_url + "/props").json()
    assert props["default_generation_settings"]["params"]["n_predict"] == DEFAULT_MAX_TOKENS


def test_served_model_name_and_alias(capped, live_server):
    assert capped("GET", "/v1/models").json()["data"][0]["id"] == "coder"
    for name in ("coder", "spruce"):
        assert capped("GET", f"/v1/models/{name}").status_code == 200
    assert capped("GET", "/v1/models/gpt-4").status_code == 404
    assert capped("POST", CHAT, {"messages": MSG, "max_tokens": 1, "model": "gpt-4"}).json()["model"] == "coder"
    assert httpx.get(live_server.base_url + "/v1/models/spruce").status_code == 200


@pytest.mark.parametrize("route,base", [(CHAT, {"messages": MSG}), (COMPLETIONS, {"prompt": "def f("})])
def test_n_predict_is_honoured(live_server, route, base):
    assert tokens_of(post(live_server, route, {**base, "n_predict": 4, "ignore_eos": True})) == 4
    assert tokens_of(post(live_server, route, {**base, "n_predict": 2, "max_tokens": 9, "ignore_eos": True})) == 2


def test_whole_floats_top_p_zero_and_reasoning_efforts(live_server):
    body = {"messages": MSG, "ignore_eos": True, **OFF}
    assert tokens_of(post(live_server, CHAT, {**body, "max_tokens": 16.0})) == 16
    greedy = post(live_server, CHAT, {**body, "max_tokens": 8, "temperature": 0}).json()
    top_p0 = post(live_server, CHAT, {**body, "max_tokens": 8, "temperature": 1.0, "top_p": 0, "seed": 3}).json()
    assert top_p0["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    for effort in ("minimal", "low", "medium", "high", "xhigh", "max"):
        assert post(live_server, CHAT, {"messages": MSG, "max_tokens": 1, "reasoning_effort": effort}).status_code \
            == 200


def test_legacy_functions_and_function_role(live_server):
    fn = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}
    script = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
    with scripted_output(live_server, script):
        r = post(live_server, CHAT, {"messages": MSG, "functions": [fn], "function_call": "auto", **OFF})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    assert "tool_calls" not in choice["message"]
    history = [*MSG, {"role": "assistant", "content": None, "function_call": {"name": "get_time", "arguments": "{}"}}]
    legacy = post(live_server, CHAT, {"messages": [*history, {"role": "function", "name": "get_time",
                                                             "content": "12:00"}], "max_tokens": 0, "functions": [fn]})
    tools = post(live_server, CHAT, {"messages": [
        *MSG, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}], "max_tokens": 0,
        "tools": [{"type": "function", "function": fn}]})
    assert legacy.json()["usage"]["prompt_tokens"] == tools.json()["usage"]["prompt_tokens"]
    named = post(live_server, CHAT, {"messages": MSG, "functions": [fn], "function_call": {"name": "get_time"},
                                     "max_tokens": 40, **OFF})
    assert named.json()["choices"][0]["message"]["function_call"]["name"] == "get_time"


def test_stop_strings_wait_for_the_reasoning_to_end(live_server):
    """Thinking is on by default: a stop string inside the reasoning must not end the answer."""
    with scripted_output(live_server, "first\nsecond\n</think>\n\nthe answer\nmore text"):
        r = post(live_server, CHAT, {"messages": MSG, "stop": ["\n"]})
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "first\nsecond"
    assert message["content"] == "the answer" and r.json()["choices"][0]["finish_reason"] == "stop"


def test_usage_counts_the_tokens_returned(live_server):
    tok = live_server.bridge.engine.tokenizer
    ids = tok.encode("abc STOP def ghi jkl")
    assembler = TextAssembler(tok, ["STOP"])
    cut = next(i for i in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:i]))
    delta = assembler.feed(Step(token_ids=ids))  # one round brought the stop and tokens after it
    assert delta.text == "abc " and delta.tokens == len(ids) and delta.dropped == len(ids) - cut
    last = assembler.feed(Step(token_ids=[ids[0]], finish_reason="cancelled", stats=Stats()))
    assert last.dropped == 1 and last.finish_reason == "stop"
    body = {"prompt": "def f(", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = post(live_server, COMPLETIONS, body).json()["choices"][0]["text"]
    stop = text[3:6]
    r = post(live_server, COMPLETIONS, {**body, "stop": [stop]}).json()
    returned = r["choices"][0]["text"]
    assert returned == text[: text.find(stop)]
    assert r["usage"]["completion_tokens"] <= len(tok.encode(returned + stop))


def test_checkpoint_sampling_defaults_fill_what_the_request_leaves_out(live_server):
    planner = Planner(live_server.bridge.engine, ServerOptions())
    planner.defaults = SamplingDefaults(temperature=0.3, top_k=7, repetition_penalty=1.2)
    left_out = planner.sampling(ChatCompletionRequest(messages=MSG), 8, 0, None)
    assert (left_out.temperature, left_out.top_k, left_out.repetition_penalty, left_out.top_p) == (0.3, 7, 1.2, 1.0)
    given = planner.sampling(ChatCompletionRequest(messages=MSG, temperature=0.9, top_k=3), 8, 0, None)
    assert (given.temperature, given.top_k) == (0.9, 3)
    assert Planner(live_server.bridge.engine, ServerOptions()).sampling(
        ChatCompletionRequest(messages=MSG), 8, 0, None).temperature == 1.0  # no defaults: OpenAI's


def test_bundled_model_ships_sampling_defaults():
    from engine.generate import BUNDLED
    from engine.sampling_defaults import read_sampling_defaults

    d = read_sampling_defaults(BUNDLED / "target")
    assert d.temperature and d.top_k and d.repetition_penalty and d.repetition_penalty > 1.0
