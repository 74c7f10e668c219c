"""Large requests neither freeze the server nor make it tokenize what cannot fit: text longer than
the context can hold is refused by its byte length, /detokenize takes at most a context of ids,
bodies with too many JSON items get 413, and /health keeps answering while big requests are
handled (tokenization runs off the event loop with the GIL released)."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
BIG = 12 << 20  # characters: under the 16 MB body limit


@pytest.fixture
def tokenizer_calls(live_server, monkeypatch):
    """The characters of every text the live tokenizer's encoders are given (they still run)."""
    tok = live_server.bridge.engine.tokenizer
    calls = []
    for name in ("encode", "encode_many"):
        real = getattr(tok, name, None)
        if real is not None:
            def spy(texts, *args, _real=real, **kw):
                calls.extend(len(t) for t in ([texts] if isinstance(texts, str) else texts))
                return _real(texts, *args, **kw)

            monkeypatch.setattr(tok, name, spy)
    return calls


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x" * BIG, "max_tokens": 1}),
    (CHAT, {"messages": [{"role": "user", "content": "y" * BIG}], "max_tokens": 1}),
    (CHAT, {"messages": [{"role": "user", "content": "z" * BIG}], "max_tokens": 1, "stream": True}),
    ("/tokenize", {"content": "w" * BIG}),
    ("/completion", {"prompt": "v" * BIG}),
])
def test_text_that_cannot_fit_is_refused_before_tokenizing(live_server, tokenizer_calls, path, body):
    t0 = time.perf_counter()
    r = httpx.post(live_server.base_url + path, json=body, timeout=120)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and str(live_server.bridge.engine.config.max_context) in \
        err["message"]
    assert tokenizer_calls == []
    print(f"{path}: refused in {time.perf_counter() - t0:.2f} s")


def test_an_infill_buffer_far_beyond_the_context_is_cut_before_tokenizing(live_server, tokenizer_calls):
    """Editors send whole files: they are cut to what can matter, and the request is served."""
    body = {"input_prefix": "a = 1\n" * (BIG // 6), "input_suffix": "b = 2\n" * 1000, "n_predict": 1}
    r = httpx.post(live_server.base_url + "/infill", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["truncated"]
    assert r.json()["tokens_evaluated"] < live_server.bridge.engine.config.max_context
    assert sum(tokenizer_calls) < BIG // 10


def test_detokenize_takes_at_most_a_context_of_ids(live_server):
    context = live_server.bridge.engine.config.max_context
    r = httpx.post(live_server.base_url + "/detokenize", json={"tokens": [5] * (context + 1)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(live_server.base_url + "/detokenize", json={"tokens": [5] * context}, timeout=60)
    assert r.status_code == 200


def test_a_body_with_too_many_json_items_is_413(live_server):
    for body in ({"tokens": [1] * 300_000}, {"messages": [{"role": "user", "content": "x"}] * 100_000}):
        r = httpx.post(live_server.base_url + ("/detokenize" if "tokens" in body else CHAT), json=body, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def health_latencies(base_url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert client.get("/health").status_code == 200
            out.append(time.perf_counter() - t0)
            time.sleep(0.01)


def test_health_answers_while_large_requests_are_handled(live_server):
    """Megabyte bodies, the largest accepted chat (thousands of messages) and a refused 12 MB
    /tokenize, back to back: /health never waits long."""
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(5_000)]
    work = [("/tokenize", {"content": "u" * BIG}), ("/v1/completions", {"prompt": "x" * BIG, "max_tokens": 1}),
            ("/tokenize", {"messages": many}), ("/detokenize", {"tokens": [7] * 2000})]
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=health_latencies, args=(live_server.base_url, stop, latencies))
    poller.start()
    try:
        time.sleep(0.2)
        with httpx.Client(base_url=live_server.base_url, timeout=120) as client:
            for path, body in work:
                assert client.post(path, content=json.dumps(body),
                                   headers={"content-type": "application/json"}).status_code in (200, 400)
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join()
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"/health: {len(latencies)} probes, median {statistics.median(latencies) * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms")
    assert latencies[-1] < 1.0  # the target is 100 ms at p99 (BENCHMARKS.md); CI machines are noisy
