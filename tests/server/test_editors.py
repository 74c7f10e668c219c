"""What each editor plugin sends (the request shapes of llama.vim, llama.vscode and Continue),
replayed against the live server, with each plugin's own acceptance rules for the answer."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from server.native_routes import EditorLimits
from server.native_schemas import InfillRequest
from tests.server.test_errors import assert_error, post

PREFIX = "def fib(n):\n    if n < 2:\n        return n\n"
SUFFIX = "\n\nprint(fib(10))\n"
EXTRA = [{"filename": "util.py", "text": "def helper():\n    return 1\n"}, {"text": "x = 2\n"}]
ZED_STOPS = ["<|endoftext|>", "<|file_separator|>", "<|fim_pad|>", "<|fim_prefix|>", "<|fim_middle|>",
             "<|fim_suffix|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<PRE>", "<SUF>", "<MID>", "[PREFIX]",
             "[SUFFIX]"]


def sse_lines(live_server, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", live_server.base_url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def llama_vim_fim(n_predict: int = 16) -> dict:
    """autoload/llama.vim's /infill request."""
    return {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "    ",
            "n_predict": n_predict, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_ms",
                                "timings/predicted_n", "timings/predicted_ms", "timings/predicted_per_ms",
                                "truncated", "tokens_cached"]}


def test_llama_vim_fim_answer_passes_its_check(live_server):
    r = post(live_server, "/infill", llama_vim_fim())
    assert r.status_code == 200
    # llama.vim accepts the body only if it matches both of these on the raw text
    assert re.match(r"^\s*{", r.text) and re.search(r'"content"\s*:"', r.text)
    body = r.json()
    assert isinstance(body["content"], str) and isinstance(body["truncated"], bool)
    assert body["timings/prompt_n"] > 0 and body["timings/predicted_n"] <= 16 and body["tokens_cached"] > 0
    assert "timings/prompt_per_ms" not in body  # llama.cpp leaves unknown paths out too


def test_llama_vim_warm_up_is_prompt_only(live_server):
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": EXTRA, "prompt": "",
            "n_predict": 0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1, "t_max_predict_ms": 1,
            "response_fields": [""]}
    r = post(live_server, "/infill", warm)
    assert r.status_code == 200 and r.json() == {}
    live_server.wait_idle()
    assert live_server.bridge.history[-1].generated_tokens == 0
    full = post(live_server, "/infill", {**warm, "response_fields": None}).json()
    assert full["content"] == "" and full["tokens_predicted"] == 0 and full["stop"] is True


def test_infill_prompt_layout(live_server):
    """extra context, then <|fim_prefix|>prefix<|fim_suffix|>suffix<|fim_middle|>prompt (llama.cpp's order)."""
    tok = live_server.bridge.engine.tokenizer
    r = post(live_server, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA,
                                      "prompt": "  ", "n_predict": 0}).json()
    snippet = "\n\n--- snippet ---\n\n"
    want = tok.encode(snippet) + tok.encode(EXTRA[0]["text"]) + tok.encode(snippet) + tok.encode(EXTRA[1]["text"])
    want += tok.encode(f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>") + tok.encode("  ")
    assert r["tokens_evaluated"] == len(want) and not r["truncated"]
    assert r["prompt"] == tok.decode(want, skip_special=False)


def test_infill_that_does_not_fit_is_truncated(live_server):
    context = live_server.bridge.engine.config.max_context
    r = post(live_server, "/infill", {"input_prefix": "a = 1\n" * context, "input_suffix": "b = 2\n" * context,
                                      "n_predict": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["truncated"] and body["tokens_evaluated"] < context


@pytest.mark.parametrize("extra", [[{}], [{"filename": "a.py"}], [{"filename": 123, "text": "abc"}],
                                   [{"filename": "a", "text": 456}], "not a list"])
def test_malformed_input_extra_is_400(live_server, extra):
    assert_error(post(live_server, "/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": extra}), 400)


def test_llama_vscode_infill_with_several_completions(live_server):
    body = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "",
            "n_predict": 6, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"],
            "stream": False, "cache_prompt": True, "n_indent": 0, "t_max_prompt_ms": 500, "t_max_predict_ms": 2500}
    r = post(live_server, "/infill", body)
    assert r.status_code == 200
    answers = r.json()
    # llama.vscode takes one object {content} or an array of them
    assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1, 2]
    assert all(isinstance(a["content"], str) and a["stop"] for a in answers)
    assert post(live_server, "/infill", {**body, "n_cmpl": 9}).status_code == 400
    tokens = post(live_server, "/tokenize", {"content": PREFIX, "add_special": False, "parse_special": True}).json()
    assert tokens["tokens"] == live_server.bridge.engine.tokenizer.encode(PREFIX)
    models = httpx.get(live_server.base_url + "/v1/models").json()["data"][0]
    assert models["context_length"] == live_server.bridge.engine.config.max_context
    props = httpx.get(live_server.base_url + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == live_server.bridge.engine.config.max_context


def test_llama_vim_chat_stream(live_server):
    body = {"id_slot": 0, "messages": [{"role": "user", "content": "hi"}], "min_p": 0.1, "temperature": 0.1,
            "samplers": ["min_p", "temperature"], "cache_prompt": True, "stream": True, "max_tokens": 6}
    text = ""
    for line in sse_lines(live_server, "/v1/chat/completions", body):
        try:  # llama.vim's parser: strip "data: ", decode, ignore what does not parse or has no choice
            chunk = json.loads(line.removeprefix("data: "))
            delta = chunk["choices"][0]["delta"]
        except (ValueError, KeyError, IndexError):
            continue
        text += delta.get("content") or delta.get("reasoning_content") or ""
    assert text


def continue_stream(lines: list[str], path: tuple) -> str:
    """Continue's streamSse: stop at [DONE], raise on an error event, read the given field."""
    out = ""
    for line in lines:
        if line.startswith(": ping"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return out
        event = json.loads(data)
        if event.get("error"):
            raise AssertionError(f"Error streaming response: {event['error']['message']}")
        if event["choices"]:
            node = event["choices"][0]
            for key in path:
                node = node.get(key) if isinstance(node, dict) else None
            out += node or ""
    raise AssertionError("no [DONE]")


def test_continue_autocomplete_and_chat(live_server):
    stops = [f"\n{kw}" for kw in ("def ", "class ", "if ", "#", "@", "print", "\n\n")] + ZED_STOPS
    fim = {"prompt": f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>", "model": "m", "max_tokens": 8,
           "temperature": 0.01, "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "stop": stops,
           "stream": True}
    assert isinstance(continue_stream(sse_lines(live_server, "/v1/completions", fim), ("text",)), str)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    lines = sse_lines(live_server, "/v1/chat/completions", chat)
    assert isinstance(continue_stream(lines, ("delta", "content")), str)
    assert json.loads(lines[-2].removeprefix("data: "))["usage"]["completion_tokens"] <= 6
    assert httpx.get(live_server.base_url + "/v1/models").json()["data"][0]["max_model_len"] > 0


def test_zed_edit_prediction(live_server):
    body = {"model": "m", "prompt": f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>", "max_tokens": 8,
            "temperature": None, "stop": ZED_STOPS}
    r = post(live_server, "/v1/completions", body)
    assert r.status_code == 200 and isinstance(r.json()["choices"][0]["text"], str)


def test_tabby_openai_completion_stream(live_server):
    """Tabby parses every event as a chunk (a panic otherwise) and stops at the first finish_reason,
    which must come before [DONE]; every text must be a string."""
    body = {"model": "m", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0.1, "stream": True,
            "presence_penalty": 0.0}
    lines = sse_lines(live_server, "/v1/completions", body)
    for line in lines:
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            raise AssertionError("[DONE] before a finish_reason")
        chunk = json.loads(data)
        assert isinstance(chunk["choices"][0]["text"], str)
        if chunk["choices"][0]["finish_reason"] is not None:
            break
    assert lines[-1] == "data: [DONE]"


def test_tabby_and_continue_llama_cpp_completion(live_server):
    body = {"seed": 7, "prompt": f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>", "n_predict": 6,
            "temperature": 0.1, "stream": True, "penalty_last_n": 0, "presence_penalty": 0.0}
    events = [json.loads(line.removeprefix("data: ")) for line in sse_lines(live_server, "/completion", body)]
    assert all(isinstance(e["content"], str) for e in events)
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    final = events[-1]
    assert final["tokens_predicted"] <= 6 and final["stop_type"] in ("eos", "limit", "word")
    whole = post(live_server, "/completion", {**body, "stream": False}).json()
    assert whole["content"] == "".join(e["content"] for e in events)  # same seed, same tokens


def test_tokenize_and_detokenize(live_server):
    tok = live_server.bridge.engine.tokenizer
    text = "héllo wörld 你好 <|im_end|>"
    ids = post(live_server, "/tokenize", {"content": text}).json()["tokens"]
    assert ids == tok.encode(text)
    assert post(live_server, "/detokenize", {"tokens": ids}).json()["content"] == text
    pieces = post(live_server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == text
    vllm = post(live_server, "/v1/tokenize", {"prompt": "abc"}).json()
    assert vllm["count"] == len(vllm["tokens"])
    assert vllm["max_model_len"] == live_server.bridge.engine.config.max_context
    chat = post(live_server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > len(tok.encode("hi"))
    assert_error(post(live_server, "/detokenize", {"tokens": [1, 10**9]}), 400, "tokens")
    assert_error(post(live_server, "/tokenize", {"content": "a", "prompt": "b"}), 400)
    special = post(live_server, "/tokenize", {"content": "<|im_end|>"}).json()["tokens"]
    literal = post(live_server, "/tokenize", {"content": "<|im_end|>", "parse_special": False}).json()["tokens"]
    assert special == [tok.token_id("<|im_end|>")] and literal == tok.encode("<|im_end|>", special=False)
    assert len(literal) > 1


def test_n_indent_and_time_limit_rules():
    lim = EditorLimits(InfillRequest(n_indent=4))
    assert lim.feed("x = 1\n    y") == "x = 1\n    y" and not lim.hit
    assert lim.feed(" = 2\n  ") == " = 2\n  " and not lim.hit  # only indentation so far
    assert lim.feed("z = 3\n") == "" and lim.hit  # this line is indented 2 < 4: cut before its text
    lim = EditorLimits(InfillRequest(n_indent=2))
    assert lim.feed("a\n\n  b\nc") == "a\n\n  b\n" and lim.hit  # blank lines do not count
    lim = EditorLimits(InfillRequest(t_max_predict_ms=0.001))
    lim.started -= 1.0
    assert lim.feed("no newline yet") and not lim.hit
    lim.feed("\n")
    assert lim.hit


def test_editor_sequence_reuses_the_prompt(live_server):
    """llama.vim on the hybrid model: a warm-up (n_predict 0) with the project context, the request at
    the cursor, then the next keystroke. Prefill snapshots after the FIM markers (engine/prefill.py)
    let the real request resume after the warm-up's context and the keystroke after <|fim_middle|>."""
    extra = [{"filename": f"mod{i}.py", "text": "".join(f"def helper_{i}_{j}(x):\n    return x * {j} + {i}\n"
                                                        for j in range(8))} for i in range(3)]
    prefix = "".join(f"value_{k} = compute({k}, scale={k % 7})\n" for k in range(16))
    suffix = "".join(f"print(value_{k})\n" for k in range(4))
    base = {"id_slot": 0, "input_extra": extra, "cache_prompt": True, "samplers": ["top_k", "top_p", "infill"],
            "top_k": 40, "top_p": 0.9, "stream": False}

    def cached_share(body: dict) -> tuple[int, float]:
        r = post(live_server, "/infill", {**base, **body})
        assert r.status_code == 200, r.text
        assert not r.json()["truncated"]  # the whole prompt fits the test server's context
        timings = r.json()["timings"]
        return timings["cache_n"], timings["cache_n"] / (timings["cache_n"] + timings["prompt_n"])

    cached, _ = cached_share({"input_prefix": "", "input_suffix": "", "prompt": "", "n_predict": 0})
    assert cached == 0  # nothing of this project was seen before
    cursor = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 4}
    cached, share = cached_share({**cursor, "prompt": "total = "})
    assert cached > 0 and share > 0.4  # the project context, from the warm-up
    cached, share = cached_share({**cursor, "prompt": "total = v"})
    assert share >= 0.9, share  # the keystroke: everything up to <|fim_middle|>
