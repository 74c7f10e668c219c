"""Tools, tool_choice, reasoning and response_format through the live server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.scripted import scripted_output
from tests.server.test_errors import assert_error, post

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Weather in Oslo?"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "zip": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALLS = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n0150\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=get_time>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="x", max_retries=0, timeout=60,
                         _strict_response_validation=True)


def sse_events(live_server, body: dict) -> list[dict]:
    with httpx.stream("POST", live_server.base_url + CHAT, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_tool_calls_are_parsed_out_of_the_answer(client, live_server):
    with scripted_output(live_server, CALLS):
        r = client.chat.completions.create(model="m", messages=MSG, tools=[WEATHER, TIME], extra_body=OFF)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo", "days": 3, "zip": "0150"}  # schema types
    assert json.loads(calls[1].function.arguments) == {}
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_streamed_tool_calls_follow_openai(live_server):
    with scripted_output(live_server, CALLS):
        chunks = sse_events(live_server, {"messages": MSG, "tools": [WEATHER, TIME], **OFF})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "<tool_call>" not in "".join(d.get("content") or "" for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    tool_deltas = [t for d in deltas for t in d.get("tool_calls", [])]
    starts = [t for t in tool_deltas if "id" in t]
    assert [(t["index"], t["type"], t["function"]["name"], t["function"]["arguments"]) for t in starts] == [
        (0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    assert all("id" not in t["function"] for t in tool_deltas)
    args = {i: "".join(t["function"]["arguments"] for t in tool_deltas if t["index"] == i) for i in (0, 1)}
    assert json.loads(args[0]) == {"city": "Oslo", "days": 3, "zip": "0150"} and json.loads(args[1]) == {}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls"]


def test_parallel_tool_calls_false_stops_after_one_call(client, live_server):
    with scripted_output(live_server, CALLS) as script:
        r = client.chat.completions.create(model="m", messages=MSG, tools=[WEATHER, TIME], parallel_tool_calls=False,
                                           extra_body=OFF)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.usage.completion_tokens < len(script)  # generation was cancelled once the call was complete


def test_reasoning_is_split_from_content(client, live_server):
    answer = "First, think.\n</think>\n\nThe answer."  # the prompt already opened <think>
    with scripted_output(live_server, answer):
        r = client.chat.completions.create(model="m", messages=MSG)
        chunks = sse_events(live_server, {"messages": MSG})
    msg = r.choices[0].message
    assert msg.content == "The answer." and msg.model_extra["reasoning_content"] == "First, think."
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "First, think."
    assert "".join(d.get("content") or "" for d in deltas) == "The answer."
    assert all("</think>" not in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)


def test_thinking_switches(live_server):
    """chat_template_kwargs, the top-level alias and reasoning_effort 'none' all turn thinking off."""
    def prompt_tokens(extra: dict) -> int:
        r = post(live_server, CHAT, {"messages": MSG, "max_tokens": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    on = prompt_tokens({})
    off = prompt_tokens(OFF)
    assert off > on
    assert prompt_tokens({"enable_thinking": False}) == off
    assert prompt_tokens({"reasoning_effort": "none"}) == off
    assert prompt_tokens({"reasoning_effort": "high"}) == on


def test_named_tool_choice_forces_that_call(client, live_server):
    """Enforced while decoding (server/structured.py): the tiny random model writes the named call."""
    r = client.chat.completions.create(model="m", messages=MSG, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       parallel_tool_calls=False, extra_body=OFF)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments) == {}
    assert r.choices[0].finish_reason == "tool_calls"
    chunks = sse_events(live_server, {"messages": MSG, "tools": [WEATHER], "max_tokens": 40, **OFF,
                                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    names = [t["function"].get("name") for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", [])
             if c["choices"]]
    assert names[0] == "get_weather"


def test_tool_choice_none_hides_the_tools(live_server):
    def prompt_tokens(extra: dict) -> int:
        r = post(live_server, CHAT, {"messages": MSG, "max_tokens": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    bare = prompt_tokens({})
    assert prompt_tokens({"tools": [WEATHER]}) > bare
    assert prompt_tokens({"tools": [WEATHER], "tool_choice": "none"}) == bare
    assert prompt_tokens({"tools": None, "tool_choice": None}) == bare
    # "required" is enforced while decoding, not by text added to the prompt
    assert prompt_tokens({"tools": [WEATHER], "tool_choice": "required"}) == prompt_tokens({"tools": [WEATHER]})


BAD_TOOLS = [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "hiccup"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"response_format": {"type": "sound"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": 123}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "hiccup"}}}},
     "response_format.json_schema.schema"),
    ({"functions": [{"name": "f"}], "tools": [WEATHER]}, "functions"),
    ({"tools": [WEATHER], "tool_choice": "auto", "function_call": "auto"}, "function_call"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"abc": 10}}, "logit_bias"),
    ({"logit_bias": {"99999": 10}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"enable_thinking": "yes"}, "enable_thinking"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("extra,param", BAD_TOOLS)
def test_bad_tool_and_format_requests_are_400(live_server, extra, param):
    assert_error(post(live_server, CHAT, {"messages": MSG, **extra}), 400, param)


def test_response_format_text_is_free(client):
    # ignore_eos: this random model can end its answer within two tokens (unseeded, 1 in ~150 here)
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=2, response_format={"type": "text"},
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"


def test_required_tool_calls_follow_the_declared_schemas(client):
    """tool_choice required on the tiny random model: every call names a declared tool and its
    arguments match that tool's schema (raw-text strings bounded by maxLength, an enum, an integer
    range, a boolean), which the model could not write by luck."""
    book = {"type": "function", "function": {"name": "book_room", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "maxLength": 3},
                                         "floor": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "view": {"type": "string", "enum": ["sea", "city"]},
                                         "late": {"type": "boolean"}},
        "required": ["code", "floor", "view"]}}}
    r = client.chat.completions.create(model="m", messages=MSG, tools=[book, TIME], tool_choice="required",
                                       max_tokens=120, temperature=0.8, seed=3, parallel_tool_calls=False,
                                       extra_body=OFF)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    if call.function.name == "get_time":
        assert args == {}
    else:
        assert call.function.name == "book_room" and {"code", "floor", "view"} <= set(args) <= {
            "code", "floor", "view", "late"}
        assert isinstance(args["code"], str) and len(args["code"]) <= 3
        assert isinstance(args["floor"], int) and 1 <= args["floor"] <= 9 and args["view"] in ("sea", "city")
        assert isinstance(args.get("late", False), bool)
