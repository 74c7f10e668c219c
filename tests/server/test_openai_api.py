"""The OpenAI routes through the official `openai` client against the live in-process server."""

from __future__ import annotations

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "Write a function."}]


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    # strict: every response is validated against the SDK's pydantic types
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60,
                         _strict_response_validation=True)


NO_EOS = {"ignore_eos": True}  # exact lengths, whatever this tiny random model emits


THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}}  # everything the model says is content


def chat(client, **kw):
    kw.setdefault("messages", MSG)
    kw["extra_body"] = {**THINK_OFF, **kw.get("extra_body", {})}
    return client.chat.completions.create(model="anything", **kw)


def test_chat_non_stream_shape_usage_and_timings(client, live_server):
    r = chat(client, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == live_server.model_id
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    t = r.model_extra["timings"]
    assert t["predicted_n"] == u.completion_tokens
    assert t["prompt_n"] + t["cache_n"] == u.prompt_tokens
    assert t["predicted_ms"] > 0 and t["predicted_per_second"] > 0 and t["tokens_per_forward"] >= 1.0
    assert {"prompt_ms", "draft_n", "draft_n_accepted"} <= t.keys()


def test_max_tokens_gives_length(client):
    r = chat(client, max_tokens=3, temperature=0, extra_body=NO_EOS)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    r2 = chat(client, max_tokens=50, max_completion_tokens=2, temperature=0, extra_body=NO_EOS)
    assert r2.usage.completion_tokens == 2  # max_completion_tokens wins


def test_chat_stream_chunk_sequence(client):
    chunks = list(chat(client, max_tokens=10, temperature=0, stream=True))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishes) == 1 and finishes[0] is chunks[-1]
    assert chunks[-1].choices[0].delta.content is None
    assert all(c.choices[0].delta.content for c in chunks[1:-1])  # content deltas are never empty
    assert all(c.usage is None for c in chunks)


def test_stream_equals_non_stream_and_ends_with_done(client, live_server):
    text = chat(client, max_tokens=16, temperature=0).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, max_tokens=16, temperature=0,
                                                                         stream=True))
    assert streamed == text
    with httpx.stream("POST", live_server.base_url + "/v1/chat/completions",
                      json={"messages": MSG, "max_tokens": 4, "stream": True}, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        body = resp.read().decode()
    events = [e for e in body.split("\n\n") if e.strip() and not e.startswith(":")]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and body.endswith("data: [DONE]\n\n")
    assert "\r" not in body


def test_include_usage_adds_a_final_usage_chunk(client):
    chunks = list(chat(client, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
                       extra_body=NO_EOS))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert last.usage.completion_tokens == 6
    assert last.model_extra["timings"]["predicted_n"] == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_string_and_token_prompt(client):
    r = client.completions.create(model="x", prompt="def main(", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].text, str)
    ids = httpx.post(f"{client.base_url}completions", json={"prompt": "def main(", "max_tokens": 0}).json()
    assert ids["usage"]["prompt_tokens"] == r.usage.prompt_tokens
    default = client.completions.create(model="x", prompt="import os\n", temperature=0)
    assert default.usage.completion_tokens <= 16  # the OpenAI default max_tokens for completions


def test_completions_token_ids_match_text_prompt(client, live_server):
    tok = live_server.bridge.engine.tokenizer
    ids = tok.encode("class A:\n")
    by_text = client.completions.create(model="x", prompt="class A:\n", max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="x", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completions_stream(live_server):
    # Not strict: the SDK types a legacy completion chunk with the non-null finish_reason of a full
    # Completion, while OpenAI itself (and every server) streams finish_reason null until the end.
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(client.completions.create(model="x", prompt="x = ", max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks[:-1]].count("length") == 1
    assert chunks[-2].choices[0].finish_reason == "length"


def greedy_text(client, n: int = 40) -> str:
    r = chat(client, max_tokens=n, temperature=0, extra_body=NO_EOS)
    assert r.choices[0].finish_reason == "length"
    return r.choices[0].message.content


def pick_stop(text: str) -> str:
    """A 2-3 character piece of the greedy text, starting at its first occurrence after index 5."""
    for i in range(5, len(text) - 3):
        stop = text[i : i + 3].strip()
        if len(stop) >= 2 and "\ufffd" not in stop and text.find(stop) >= 5:
            return stop
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string_cuts_text_stream_and_non_stream(client):
    text = greedy_text(client)
    stop = pick_stop(text)
    want = text[: text.find(stop)]
    stops = [f"never-{i}" for i in range(7)] + [stop]  # more than OpenAI's 4
    r = chat(client, max_tokens=40, temperature=0, stop=stops, extra_body=NO_EOS)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in chat(client, max_tokens=40, temperature=0, stop=stops,
                                                                stream=True, extra_body=NO_EOS)]
    assert "".join(pieces) == want
    single = chat(client, max_tokens=40, temperature=0, stop=stop, extra_body=NO_EOS)
    assert single.choices[0].message.content == want


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return chat(client, max_tokens=12, temperature=1.0, seed=seed).choices[0].message.content

    assert sample(1234) == sample(1234)
    assert sample(-(2**63)) == sample(-(2**63))  # the whole int64 range is accepted
    assert len({sample(s) for s in range(4)}) > 1


def test_models_and_health(client, live_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [live_server.model_id]
    assert models.data[0].owned_by and models.data[0].object == "model"
    assert client.models.retrieve(live_server.model_id).id == live_server.model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    for path in ("/health", "/v1/health"):
        r = httpx.get(live_server.base_url + path)
        assert r.status_code == 200 and r.json()["status"] == "ok"


def test_routes_without_v1_prefix(live_server):
    base = live_server.base_url
    r = httpx.post(base + "/chat/completions", json={"messages": MSG, "max_tokens": 2}, timeout=60)  # any length
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = httpx.post(base + "/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    assert httpx.get(base + "/models").json()["data"][0]["id"] == live_server.model_id


def test_thinking_toggle_changes_the_prompt(client):
    on = chat(client, max_tokens=1, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": True}}).usage.prompt_tokens
    off = chat(client, max_tokens=1, temperature=0,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage.prompt_tokens
    assert off > on  # the empty <think>\n\n</think>\n\n block


# repeats: the prompt's last tokens occurred before, with tokens after them, so prompt lookup has
# strong evidence from its first round and tries a tree (where its hindsight says guesses miss, weak
# evidence tries none: engine/spec_evidence.py, and this random model's own text does not repeat)
REPEATS = "def f(x):\n    return x + 1\n\ndef f(x):\n    return x + 1\n\ndef f(x):\n    return"


def test_per_request_spec_is_lossless(client):
    def complete(**extra):
        return client.completions.create(model="anything", prompt=REPEATS, max_tokens=64, temperature=0,
                                         extra_body={**NO_EOS, **extra})

    plain = complete()
    spec = complete(spec={"method": "ngram", "budget": 4, "max_depth": 2})
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.usage.completion_tokens == 64
    timings = spec.model_extra["timings"]
    assert timings["draft_n"] > 0  # prompt lookup drafted (little of it is accepted: the model's
    # text does not repeat; tests/server/test_spec_edges.py has a drafter that is)
    assert timings["draft_n"] >= timings["draft_n_accepted"] >= 0
    per_pos = timings["draft_n_accepted_per_pos"]
    assert sum(per_pos) == timings["draft_n_accepted"] and per_pos == sorted(per_pos, reverse=True)
