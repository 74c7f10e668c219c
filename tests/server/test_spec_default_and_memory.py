"""A server started with speculation on (as --spec auto picks it) serves requests that turn it off
with `"spec": "none"` or `{"method": "none"}`; /props reports the weights' and caches' bytes."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engine.config import EngineConfig, SpecConfig
from engine.generate import Engine
from server.app import create_app
from server.bridge import EngineBridge

# repeats, so that prompt lookup finds continuations from the first round on
PROMPT = "def f(x):\n    return x + 1\n\ndef f(x):\n    return x + 1\n\ndef f(x):\n    return"


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    config = EngineConfig(model_path=str(tiny_checkpoint), model_id="org/tiny", spec=SpecConfig(method="ngram"))
    bridge = EngineBridge(lambda: Engine(config), max_queue=2)
    bridge.start()
    with TestClient(create_app(bridge), base_url="http://localhost") as c:
        yield c
    bridge.stop()


def complete(client, **extra):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_spec_none_turns_the_server_default_off(client):
    default = complete(client)
    assert default["timings"]["draft_n"] > 0
    for off in ("none", {"method": "none"}):
        plain = complete(client, spec=off)
        assert plain["timings"]["draft_n"] == 0
        assert plain["choices"][0]["text"] == default["choices"][0]["text"]
    assert complete(client, spec="ngram")["timings"]["draft_n"] > 0


def test_bad_spec_name_is_a_400(client):
    r = client.post("/v1/completions", json={"prompt": "x", "spec": "magic"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "spec.method"


def test_props_reports_memory(client):
    complete(client)
    memory = client.get("/props").json()["memory"]
    assert memory["dtype"] == "float32"
    assert memory["weights_bytes"] > 0 and memory["cache_bytes"] > 0
    assert memory["prefix_cache_bytes"] >= 0 and memory["draft_weights_bytes"] == 0
    assert client.get("/v1/models").json()["data"][0]["id"] == "org/tiny"
