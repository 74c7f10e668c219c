"""Numeric edge cases in every numeric field of the generation routes: zeros, subnormals, the
float and int64 limits and just past them. Each answer is a 200 or a 400 in OpenAI's shape,
never a 5xx (tiny temperatures used to overflow the logits to NaN)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server.app import create_app
from server.planning import ServerOptions

VALUES = [0, -0.0, 1, -1, 0.5, 1e-308, 2.2250738585072014e-308, 1e-320, 5e-324, 1e-45, 0.9999999999999999,
          1.0000000000000002, 2.0, 2.0000000000000004, 100, 100.00000000000001, -100, 1e308,
          1.7976931348623157e308, -1.7976931348623157e308, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63),
          -(2**63) - 1]
SAMPLING = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed"]
FIELDS = {
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
                             SAMPLING + ["max_tokens", "max_completion_tokens", "n", "top_logprobs", "logit_bias",
                                         "spec.budget", "spec.max_depth"]),
    "/v1/completions": ({"prompt": "def f("}, SAMPLING + ["max_tokens", "n", "logprobs", "logit_bias"]),
    "/completion": ({"prompt": "def f("}, SAMPLING + ["n_predict", "max_tokens", "n_cmpl", "n_indent",
                                                      "t_max_predict_ms"]),
}
FIELDS["/infill"] = ({"input_prefix": "def f(", "input_suffix": ")\n"}, FIELDS["/completion"][1])


@pytest.fixture(scope="module")
def send(live_server):
    app = create_app(live_server.bridge, ServerOptions(max_tokens_cap=1))
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=120)

    def post(path: str, body: dict) -> httpx.Response:
        return loop.run_until_complete(client.post(path, content=json.dumps(body),
                                                   headers={"content-type": "application/json"}))

    yield post
    loop.run_until_complete(client.aclose())
    loop.close()


def with_value(base: dict, field: str, value) -> dict:
    body = dict(base)
    if field == "logit_bias":
        body["logit_bias"] = {"5": value}
    elif field.startswith("spec."):
        body["spec"] = {"method": "ngram", field[5:]: value}
    else:
        body[field] = value
    return body


@pytest.mark.parametrize("route", list(FIELDS))
def test_numeric_edge_values_never_5xx(send, live_server, route):
    base, fields = FIELDS[route]
    statuses = {}
    for field in fields:
        for value in VALUES:
            r = send(route, with_value(base, field, value))
            statuses[(field, value)] = r.status_code
            if r.status_code != 200:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, r.text
    bad = {k: v for k, v in statuses.items() if v >= 500}
    assert not bad, bad
    assert live_server.bridge.alive
    counts = {s: sum(1 for v in statuses.values() if v == s) for s in sorted(set(statuses.values()))}
    print(f"{route}: {len(statuses)} numeric edge cases, statuses {counts}")
