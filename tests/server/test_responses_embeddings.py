"""/v1/embeddings and /v1/responses through the official openai SDK, with strict response validation."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest

from tests.server.scripted import scripted_output

OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="x", max_retries=0, timeout=60,
                         _strict_response_validation=True)


def test_embeddings(live_server):
    # the SDK asks for base64 by itself and decodes it after validation, which a strict client refuses
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.embeddings.create(model="anything", input=["def f(x):", "def f(x):", "import os"])
    vectors = [np.array(d.embedding) for d in r.data]
    hidden = live_server.bridge.engine.model.args.hidden_size
    assert [d.index for d in r.data] == [0, 1, 2] and all(v.shape == (hidden,) for v in vectors)
    assert all(abs(np.linalg.norm(v) - 1) < 1e-4 for v in vectors)
    assert np.allclose(vectors[0], vectors[1]) and not np.allclose(vectors[0], vectors[2])
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0
    floats = client.embeddings.create(model="m", input="def f(x):", encoding_format="float")  # the SDK's default
    assert np.allclose(floats.data[0].embedding, vectors[0], atol=1e-6)  # is base64, which it decodes itself
    raw = client.embeddings.with_raw_response.create(model="m", input=[[5, 6, 7]], encoding_format="base64")
    blob = json.loads(raw.text)["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(blob), dtype="<f4").shape == (hidden,)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="m", input="x", dimensions=hidden + 1)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="m", input="")


def test_responses_text_and_conversation(client):
    # greedy: a sampled answer of the random test model can end before max_output_tokens (seen in CI)
    r = client.responses.create(model="spruce", input="Say hi", max_output_tokens=6, temperature=0, extra_body=OFF)
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    follow = client.responses.create(model="spruce", input="And again", previous_response_id=r.id,
                                     max_output_tokens=2, extra_body=OFF)
    assert follow.previous_response_id == r.id
    assert follow.usage.input_tokens > r.usage.input_tokens + 2  # the first turn and its answer come first
    assert follow.usage.input_tokens_details.cached_tokens > 0  # ... from the prefix cache
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="spruce", input="x", previous_response_id="resp_unknown")


def test_responses_stream_events(client):
    with client.responses.stream(model="spruce", input="Say hi", max_output_tokens=5, temperature=0,
                                 extra_body=OFF) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # as OpenAI ends a response cut by max_output_tokens
    final = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and "response.output_item.done" in kinds
    with client.responses.stream(model="spruce", input="Say hi", max_output_tokens=40, extra_body=OFF,
                                 text={"format": {"type": "json_schema", "name": "a", "schema": {
                                     "type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                                     "additionalProperties": False}}}) as stream:
        for _ in stream:
            pass
        done = stream.get_final_response()  # needs response.completed: the grammar ends the JSON in time
    assert isinstance(json.loads(done.output_text), dict)


def test_responses_reasoning_and_tool_calls(client, live_server):
    tools = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    script = ("I should look it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
              "</parameter>\n</function>\n</tool_call>")
    with scripted_output(live_server, script):
        r = client.responses.create(model="spruce", input="Weather in Oslo?", tools=tools)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == "I should look it up."
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    follow_input = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    with scripted_output(live_server, "</think>\n\nIt is sunny."):
        done = client.responses.create(model="spruce", input=follow_input, previous_response_id=r.id, tools=tools)
    assert done.output_text == "It is sunny." and done.status == "completed"


def test_responses_tool_choice_is_enforced(client):
    tools = [{"type": "function", "name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
        "additionalProperties": False}}]
    r = client.responses.create(model="spruce", input="pick one", tools=tools, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, extra_body=OFF)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "pick"
    assert json.loads(calls[0].arguments)["color"] in ("red", "blue")


def test_responses_json_schema_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.responses.create(model="spruce", input="answer", max_output_tokens=80, extra_body=OFF,
                                text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    value = json.loads(r.output_text)
    assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 9 and set(value) == {"ok", "n"}
