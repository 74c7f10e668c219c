"""logprobs, n, penalties, seed, fill-in-the-middle (suffix), echo and batched prompts, live."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.planning import choice_seed
from tests.server.test_errors import post

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Count to ten."}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="x", max_retries=0, timeout=60,
                         _strict_response_validation=True)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(live_server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", live_server.base_url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_chat_logprobs(client, live_server):
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=12, logprobs=True, top_logprobs=3,
                                       extra_body={**OFF, **GREEDY})
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 12
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        # greedy without penalties: the chosen token is the raw distribution's argmax
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    specials = set(live_server.bridge.engine.tokenizer.special_tokens)  # logprobs show them, content does not
    text = b"".join(bytes(e.bytes) for e in entries if e.token not in specials).decode("utf-8", errors="replace")
    assert text == r.choices[0].message.content
    bare = client.chat.completions.create(model="m", messages=MSG, max_tokens=2, extra_body=OFF)
    assert bare.choices[0].logprobs is None
    # sampled, unseeded: ignore_eos, so that a first token drawn as the end of text cannot leave no entries
    zero = client.chat.completions.create(model="m", messages=MSG, max_tokens=2, logprobs=True, top_logprobs=0,
                                          extra_body={**OFF, "ignore_eos": True})
    assert zero.choices[0].logprobs.content and all(e.top_logprobs == [] for e in zero.choices[0].logprobs.content)


def test_streamed_logprobs_equal_non_streamed(live_server):
    body = {"messages": MSG, "max_tokens": 10, "logprobs": True, "top_logprobs": 2, **OFF, **GREEDY}
    whole = ok(post(live_server, CHAT, body))["choices"][0]["logprobs"]["content"]
    chunks = stream_chunks(live_server, CHAT, body)
    streamed = [e for c in chunks for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert [(e["token"], e["bytes"]) for e in streamed] == [(e["token"], e["bytes"]) for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole], abs=1e-4)


def test_logprobs_stop_at_a_stop_string(live_server):
    base = {"messages": MSG, "max_tokens": 30, "logprobs": True, **OFF, **GREEDY}
    text = ok(post(live_server, CHAT, base))["choices"][0]["message"]["content"]
    stop = text[8:11]
    r = ok(post(live_server, CHAT, {**base, "stop": [stop]}))["choices"][0]
    cut = r["message"]["content"]
    assert r["finish_reason"] == "stop" and cut == text[: text.find(stop)]
    shown = b"".join(bytes(e["bytes"]) for e in r["logprobs"]["content"]).decode("utf-8", errors="replace")
    assert shown.startswith(cut) and not shown.startswith(text[: text.find(stop) + len(stop)])


def test_legacy_completion_logprobs_and_echo(client, live_server):
    r = client.completions.create(model="m", prompt="def main(", max_tokens=8, logprobs=3, extra_body=GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(max(t.values()) >= v for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    # Not strict: the SDK types token_logprobs as floats, but echoed prompt tokens have null ones (as
    # OpenAI's own first token): the engine scores generated tokens only.
    loose = openai.OpenAI(base_url=client.base_url, api_key="x", max_retries=0, timeout=60)
    e = loose.completions.create(model="m", prompt="def main(", max_tokens=8, logprobs=1, echo=True,
                                 extra_body=GREEDY).choices[0]
    n_prompt = len(live_server.bridge.engine.tokenizer.encode("def main("))
    assert e.text == "def main(" + r.choices[0].text
    assert e.logprobs.token_logprobs[:n_prompt] == [None] * n_prompt and e.logprobs.top_logprobs[0] is None
    assert e.logprobs.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert e.logprobs.text_offset[n_prompt] == len("def main(")


def test_streamed_echo_starts_with_the_prompt(live_server):
    chunks = stream_chunks(live_server, COMPLETIONS, {"prompt": "x = ", "max_tokens": 4, "echo": True, **GREEDY})
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts[0] == "x = "
    whole = ok(post(live_server, COMPLETIONS, {"prompt": "x = ", "max_tokens": 4, "echo": True, **GREEDY}))
    assert "".join(texts) == whole["choices"][0]["text"]


def test_n_choices_use_consecutive_seeds(client):
    def run(n, seed):
        return client.chat.completions.create(model="m", messages=MSG, max_tokens=8, temperature=1.0, n=n,
                                              seed=seed, extra_body=OFF)

    three = run(3, 7)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert texts == [run(1, 7 + i).choices[0].message.content for i in range(3)]
    assert len(set(texts)) > 1
    assert 3 <= three.usage.completion_tokens <= 24
    assert choice_seed(2**63 - 1, 1) == -(2**63)  # wraps within int64


def test_streamed_n_gives_each_choice_its_own_sequence(live_server):
    body = {"messages": MSG, "max_tokens": 5, "n": 2, "seed": 3, "temperature": 1.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **OFF}
    chunks = stream_chunks(live_server, CHAT, body)
    whole = ok(post(live_server, CHAT, {k: v for k, v in body.items() if k != "stream_options"}))
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [m["finish_reason"] for m in mine].count("length") == 1 and mine[-1]["finish_reason"] == "length"
        assert "".join(m["delta"].get("content", "") for m in mine) == whole["choices"][i]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_penalties_reach_the_engine(live_server):
    """A random tiny model repeats itself under greedy decoding; a frequency penalty changes that."""
    base = {"messages": MSG, "max_tokens": 48, **OFF, **GREEDY}
    plain = ok(post(live_server, CHAT, base))["choices"][0]["message"]["content"]
    for penalty in ("frequency_penalty", "presence_penalty"):
        penalized = ok(post(live_server, CHAT, {**base, penalty: 2.0}))["choices"][0]["message"]["content"]
        assert penalized != plain, penalty


def test_suffix_is_fill_in_the_middle(live_server):
    body = {"prompt": "def add(a, b):\n", "suffix": "\n    return c\n", "max_tokens": 8, **GREEDY}
    fim = ok(post(live_server, COMPLETIONS, body))
    raw = ok(post(live_server, COMPLETIONS, {
        "prompt": "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c\n<|fim_middle|>", "max_tokens": 8,
        **GREEDY}))
    assert fim["choices"][0]["text"] == raw["choices"][0]["text"]
    assert fim["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
    assert post(live_server, COMPLETIONS, {**body, "echo": True}).status_code == 400


def test_batched_prompts_give_n_choices_each(live_server):
    r = ok(post(live_server, COMPLETIONS, {"prompt": ["a", "bb"], "n": 2, "max_tokens": 3, **GREEDY}))
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    single = [ok(post(live_server, COMPLETIONS, {"prompt": p, "max_tokens": 3, **GREEDY}))["choices"][0]["text"]
              for p in ("a", "bb")]
    assert [c["text"] for c in r["choices"]] == [single[0], single[0], single[1], single[1]]
    tok = live_server.bridge.engine.tokenizer
    assert r["usage"]["prompt_tokens"] == len(tok.encode("a")) + len(tok.encode("bb"))
    assert r["usage"]["completion_tokens"] == 12


def test_max_tokens_zero_only_reads_the_prompt(live_server):
    r = ok(post(live_server, CHAT, {"messages": MSG, "max_tokens": 0}))
    assert r["usage"]["completion_tokens"] == 0 and r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["message"]["content"] == ""


def test_fim_needs_the_tokenizers_fim_tokens():
    """A model without <|fim_prefix|> etc.: suffix and /infill are clear 400s, not a wrong prompt."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from engine.config import EngineConfig
    from engine.tokenizer import Tokenizer
    from server.errors import APIError
    from server.native_routes import plan_infill
    from server.native_schemas import InfillRequest
    from server.planning import Planner, ServerOptions
    from server.schemas import CompletionRequest

    plain = Tokenizer(HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    engine = SimpleNamespace(tokenizer=plain, config=EngineConfig(model_path="unused"), vocab_size=2)
    planner = Planner(engine, ServerOptions())
    with pytest.raises(APIError) as e:
        planner.completion(CompletionRequest(prompt="a", suffix="a"))
    assert e.value.status == 400 and e.value.param == "suffix" and "fill-in-the-middle" in e.value.message
    with pytest.raises(APIError) as e:
        plan_infill(planner, InfillRequest(input_prefix="a"))
    assert e.value.status == 400 and "<|fim_prefix|>" in e.value.message



def test_logit_bias_forces_a_token(live_server):
    base = live_server.base_url
    tok = ok(httpx.post(base + "/tokenize", json={"content": "return"}))["tokens"][0]
    piece = ok(httpx.post(base + "/detokenize", json={"tokens": [tok]}))["content"]
    body = {"model": "m", "prompt": "def f(", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(tok): 100}}
    assert ok(post(live_server, COMPLETIONS, body))["choices"][0]["text"] == piece * 3
