"""Property-based fuzzing of every route with random request bodies, against the real app and the
real engine thread (in-process ASGI for speed; the shared live engine).

Each body is a valid request with some fields replaced by random JSON (wrong types, huge numbers,
unicode, nested junk), plausible-but-odd structures for messages and tools, or a random value or
byte string instead of the whole body. Every answer must be one of the expected statuses with the
OpenAI error shape, never a 5xx, 422, an exception or an SSE error event; and the server must still
answer a normal request afterwards. A server-wide token cap keeps valid requests short.

Every generation route is also fuzzed under each speculation method (the `spec` field forced), on
an engine with a draft model. SPRUCE_FUZZ_EXAMPLES=N sets the bodies per route (and per route and
method); each test prints how many bodies got which status.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.parse
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from server.app import create_app
from server.planning import ServerOptions

ALLOWED = {200, 400, 404, 405, 413, 415, 429}
# SPRUCE_FUZZ_EXAMPLES=N: a longer, randomized run (default: a fixed, quick set)
LONG_RUN = os.environ.get("SPRUCE_FUZZ_EXAMPLES")
EXAMPLES = int(LONG_RUN or 45)
SPEC_EXAMPLES = int(LONG_RUN or 40)
METHODS = ["none", "ngram", "draft", "draft-tree"]
GENERATION_ROUTES = ["/v1/chat/completions", "/v1/completions", "/infill", "/completion"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
    | st.sampled_from([2**63, -(2**63) - 1, 10**30, 1e308, -1, 0, 1, 129, 2**31, "", "\ud800x", "\x00", "é" * 40]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
texts = st.text(max_size=40) | json_values
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer"]) | json_values},
    optional={"content": texts | st.lists(st.fixed_dictionaries({"type": st.just("text") | json_values,
                                                                 "text": texts}), max_size=3),
              "reasoning_content": texts, "name": texts, "tool_call_id": texts,
              "tool_calls": st.lists(st.fixed_dictionaries(
                  {"function": st.fixed_dictionaries({"name": texts, "arguments": texts | json_values})},
                  optional={"id": texts, "type": st.just("function") | json_values}), max_size=2)})
schema = st.fixed_dictionaries({}, optional={"type": st.sampled_from(["object", "string", "hiccup"]) | json_values,
                                             "properties": st.dictionaries(st.text(max_size=5), json_values,
                                                                           max_size=3),
                                             "required": json_values})
tool = st.fixed_dictionaries({"type": st.just("function") | json_values,
                              "function": st.fixed_dictionaries({"name": st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
                                                                 | texts}, optional={"parameters": schema,
                                                                                     "description": texts})})
SPECIAL = {
    "messages": st.lists(message, max_size=4),
    "tools": st.lists(tool, max_size=3),
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": texts})}),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                                             optional={"schema": schema, "json_schema": st.fixed_dictionaries(
                                                 {}, optional={"name": texts, "schema": schema})}),
    "input_extra": st.lists(st.fixed_dictionaries({}, optional={"filename": texts, "text": texts}), max_size=3),
    "stop": st.lists(st.text(max_size=6), max_size=20),
    "prompt": st.lists(st.integers(-5, 600), max_size=20) | st.lists(st.text(max_size=10), max_size=3),
    "tokens": st.lists(st.integers(-5, 600), max_size=20),
}

CHAT_FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
               "stream", "stream_options", "n", "presence_penalty", "frequency_penalty", "logit_bias", "user",
               "ignore_eos", "spec", "tools", "tool_choice", "parallel_tool_calls", "response_format", "logprobs",
               "top_logprobs", "chat_template_kwargs", "enable_thinking", "reasoning_effort", "messages"]
NATIVE_FIELDS = ["n_predict", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stream",
                 "presence_penalty", "frequency_penalty", "ignore_eos", "n_cmpl", "n_indent", "t_max_predict_ms",
                 "response_fields", "spec", "cache_prompt", "samplers", "id_slot"]
ROUTES = {
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, CHAT_FIELDS),
    "/v1/completions": ({"prompt": "hi", "max_tokens": 2},
                        [f for f in CHAT_FIELDS if f not in ("messages", "tools", "tool_choice", "response_format")]
                        + ["prompt", "suffix", "echo", "logprobs"]),
    "/infill": ({"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 2},
                NATIVE_FIELDS + ["input_prefix", "input_suffix", "input_extra", "prompt"]),
    "/completion": ({"prompt": "x", "n_predict": 2}, NATIVE_FIELDS + ["prompt"]),
    "/tokenize": ({"content": "hello"}, ["content", "prompt", "messages", "add_special", "parse_special",
                                         "with_pieces", "chat_template_kwargs"]),
    "/detokenize": ({"tokens": [1, 2, 3]}, ["tokens"]),
}


@pytest.fixture(scope="module")
def fuzz(live_server):
    """send(method, path, body): an ASGI client over the live engine with a small token cap and body limit."""
    yield from asgi_sender(live_server.bridge)


@pytest.fixture(scope="module")
def spec_fuzz(draft_bridge):
    """The same over the engine with a draft model."""
    yield from asgi_sender(draft_bridge)


def asgi_sender(bridge):
    app = create_app(bridge, ServerOptions(max_tokens_cap=4, max_body_bytes=64 << 10))
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=120)

    def send(method: str, path: str, content: bytes | None = None) -> httpx.Response:
        headers = {"content-type": "application/json"} if content is not None else {}
        return loop.run_until_complete(client.request(method, path, content=content, headers=headers))

    yield send
    loop.run_until_complete(client.aclose())
    for task in asyncio.all_tasks(loop):  # sse-starlette's shutdown watchers
        task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()


def check(r: httpx.Response) -> None:
    assert r.status_code in ALLOWED, (r.status_code, r.text[:500])
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        assert err["type"] in ("invalid_request_error", "rate_limit_error") and err["message"]
        assert err["param"] is None or isinstance(err["param"], str)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), line
    else:
        r.json()


@st.composite
def mutated(draw, path: str, spec_method: str | None = None) -> bytes:
    """The route's valid body with up to 4 known fields (and maybe one unknown) set to random values;
    with spec_method, the body asks for that speculation method (budget and depth maybe random)."""
    base, fields = ROUTES[path]
    body = dict(base)
    if spec_method is not None:  # the token budget at its edges: 0, 1 (no room to draft), 2, ...
        fields = [f for f in fields if f != "spec"]
        body["n_predict" if "n_predict" in body else "max_tokens"] = draw(st.integers(0, 4))
    for key in draw(st.lists(st.sampled_from(fields), max_size=4, unique=True)):
        body[key] = draw(SPECIAL[key] | json_values if key in SPECIAL else json_values)
    if draw(st.booleans()):
        body[draw(st.text(max_size=6))] = draw(json_values)
    if spec_method is not None:
        body["spec"] = draw(st.fixed_dictionaries({"method": st.just(spec_method)}, optional={
            "budget": st.integers(0, 40) | json_values, "max_depth": st.integers(0, 20) | json_values}))
    return json.dumps(body).encode()


def bodies(path: str):
    whole = json_values.map(lambda v: json.dumps(v).encode())
    return st.one_of(mutated(path), mutated(path), whole, st.binary(max_size=64))


STATUSES: Counter = Counter()  # (route, spec method, status) -> bodies


@pytest.mark.parametrize("path", list(ROUTES))
def test_random_bodies_never_break_the_server(fuzz, live_server, path):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=LONG_RUN is None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies(path))
    def one(raw: bytes):
        r = fuzz("POST", path, raw)
        STATUSES[(path, "-", r.status_code)] += 1
        check(r)
        assert live_server.bridge.alive

    one()
    assert_still_serves(fuzz)
    report(path, "-")


def report(path: str, method: str) -> None:
    counts = {s: n for (p, m, s), n in sorted(STATUSES.items()) if (p, m) == (path, method)}
    print(f"fuzz {path} spec={method}: {sum(counts.values())} bodies, statuses {counts}")


@pytest.mark.parametrize("path", GENERATION_ROUTES)
@pytest.mark.parametrize("method", METHODS)
def test_random_bodies_under_each_spec_method(spec_fuzz, draft_bridge, path, method):
    """The draft-model methods meet one token of room (max_tokens 1, or the last token of a short
    budget) in these bodies (issue 11 item 2: 500s before the loop told drafters about root-only
    rounds)."""
    # no shrinking: a failing body is reported as drawn (shrinking the xfail cases cost seconds each)
    @settings(max_examples=SPEC_EXAMPLES, deadline=None, derandomize=LONG_RUN is None,
              phases=[Phase.explicit, Phase.reuse, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutated(path, method))
    def one(raw: bytes):
        r = spec_fuzz("POST", path, raw)
        STATUSES[(path, method, r.status_code)] += 1
        check(r)
        assert draft_bridge.alive

    try:
        one()
    finally:
        report(path, method)
    base = dict(ROUTES[path][0])
    base["n_predict" if "n_predict" in base else "max_tokens"] = 1  # always among the bodies: one token of room
    check(spec_fuzz("POST", path, json.dumps({**base, "spec": {"method": method}}).encode()))
    assert_still_serves(spec_fuzz)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.text(max_size=20), st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
def test_random_paths_and_methods(fuzz, name, method):
    check(fuzz(method, "/v1/models/" + urllib.parse.quote(name, safe="")))
    check(fuzz(method, "/" + urllib.parse.quote(name)))


NASTY = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"prompt": "\\udfff abc"}',
    b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b'{"prompt": "a", "temperature": NaN}',
    b'{"prompt": "a", "top_p": Infinity}',
    b'{"prompt": "a", "max_tokens": 1e400}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", '
    b'"parameters": ' + b'{"items": ' * 500 + b"{}" + b"}" * 500 + b"}}]}",
    json.dumps({"prompt": "x" * 70_000}).encode(),
    b"",
    b"null",
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/infill", "/tokenize"])
@pytest.mark.parametrize("raw", NASTY, ids=range(len(NASTY)))
def test_nasty_bodies(fuzz, path, raw):
    check(fuzz("POST", path, raw))


def assert_still_serves(fuzz) -> None:
    r = fuzz("POST", "/v1/chat/completions",
             json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True,
                         "temperature": 0}).encode())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2

