"""Single slot: FIFO queue, 429 when full, and cancellation on client disconnect (queued or running)."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from tests.server.conftest import MAX_QUEUE, serving

# this module's own server, with room for requests that run for seconds: the tiny model decodes
# ~5,000 tokens a second on the dev CPU, so the shared server's 2,048 tokens could end before a
# client's disconnect was seen (a non-streamed one is polled for)
QUEUE_CONTEXT = 65536
LONG = QUEUE_CONTEXT - 100  # tokens: seconds of decoding even on a fast machine


@pytest.fixture(scope="module")
def live_server(tiny_checkpoint):
    with serving(tiny_checkpoint, QUEUE_CONTEXT) as server:
        yield server


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def long_body() -> dict:
    """A request that would run LONG tokens (EOS ignored), far longer than any test waits."""
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}


def open_stream(stack: contextlib.ExitStack, client: httpx.Client, body: dict):
    """Start a streamed request (closed with the stack), read its role chunk; -> the remaining lines.

    Keep the returned iterator referenced: when it is garbage collected, httpx closes the connection.
    """
    resp = stack.enter_context(client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}))
    assert resp.status_code == 200
    lines = resp.iter_lines()
    assert '"role":"assistant"' in next(line for line in lines if line.startswith("data: "))
    return lines


def last_finished(live_server, n: int = 1):
    live_server.wait_idle()
    return list(live_server.bridge.history)[-n:]


def test_disconnect_mid_stream_cancels_the_running_request(live_server, long_body):
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client, contextlib.ExitStack() as stack:
        lines = open_stream(stack, client, long_body)
        content = (line for line in lines if '"content":"' in line)
        assert next(content) and next(content)  # generation is running
    (done,) = last_finished(live_server)
    assert done.finish_reason == "cancelled" and done.ran and done.generated_tokens < LONG
    r = httpx.post(live_server.base_url + "/v1/chat/completions", json={**long_body, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_disconnect_of_a_non_streamed_request_cancels_it(live_server, long_body):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.base_url + "/v1/chat/completions", json=long_body, timeout=httpx.Timeout(60, read=0.2))
    (done,) = last_finished(live_server)
    assert done.finish_reason == "cancelled" and done.generated_tokens < LONG


def test_queued_request_cancelled_by_disconnect_never_runs(live_server, long_body):
    """A client that leaves while queued gives its slot back at once, not when the running job ends."""
    bridge = live_server.bridge
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client, contextlib.ExitStack() as running:
        running_lines = open_stream(running, client, long_body)
        with contextlib.ExitStack() as queued:
            queued_lines = open_stream(queued, client, long_body)
            wait_for(lambda: len(bridge.waiting()) == 1)
            queued_id = bridge.waiting()[0].request_id
        wait_for(lambda: not bridge.waiting())  # withdrawn while the first one still runs
        assert not bridge.idle and next(running_lines) is not None and queued_lines is not None
        withdrawn = [h for h in bridge.history if h.request_id == queued_id]
        assert [(h.ran, h.finish_reason, h.generated_tokens) for h in withdrawn] == [(False, "cancelled", 0)]
    (first,) = last_finished(live_server)
    assert first.ran and first.finish_reason == "cancelled"


def test_slots_of_clients_gone_while_queued_are_free_for_new_clients(live_server, long_body):
    """Fill the queue, let every waiting client leave: new clients get queue slots, not 429."""
    bridge = live_server.bridge
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client, contextlib.ExitStack() as running:
        running_lines = open_stream(running, client, long_body)
        with contextlib.ExitStack() as queued:
            waiting = [open_stream(queued, client, long_body) for _ in range(MAX_QUEUE)]
            wait_for(lambda: len(bridge.waiting()) == MAX_QUEUE)
            assert client.post("/v1/chat/completions", json={**long_body, "max_tokens": 2}).status_code == 429
            assert len(waiting) == MAX_QUEUE
        wait_for(lambda: not bridge.waiting())
        with contextlib.ExitStack() as again:
            newcomers = [open_stream(again, client, {**long_body, "max_tokens": 2}) for _ in range(MAX_QUEUE)]
            assert len(bridge.waiting()) == MAX_QUEUE and newcomers
        assert next(running_lines) is not None
    live_server.wait_idle()


def test_full_queue_gives_429_then_recovers(live_server, long_body):
    bridge = live_server.bridge
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client, contextlib.ExitStack() as stack:
        streams = [open_stream(stack, client, long_body) for _ in range(1 + MAX_QUEUE)]
        wait_for(lambda: len(bridge.waiting()) == MAX_QUEUE)
        r = client.post("/v1/chat/completions", json={**long_body, "max_tokens": 2})
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and set(err) == {"message", "type", "param", "code"}
        assert all(next(lines) is not None for lines in streams)  # the admitted ones are still streaming
    live_server.wait_idle()
    r = httpx.post(live_server.base_url + "/v1/chat/completions", json={**long_body, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_fifo_order(live_server, long_body):
    """Queued requests run in arrival order once the running one is gone."""
    bridge = live_server.bridge
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client, contextlib.ExitStack() as queued:
        with contextlib.ExitStack() as running:
            first = open_stream(running, client, long_body)
            streams = [open_stream(queued, client, {**long_body, "max_tokens": n}) for n in (2, 3)]
            wait_for(lambda: len(bridge.waiting()) == 2)
            ids = [r.request_id for r in bridge.waiting()]
            assert next(first) is not None
        for lines in streams:
            assert [line for line in lines if line][-1] == "data: [DONE]"
    history = last_finished(live_server, 3)
    assert [h.finish_reason for h in history] == ["cancelled", "length", "length"]
    assert [h.request_id for h in history[1:]] == ids
    assert [h.generated_tokens for h in history[1:]] == [2, 3]


def test_engine_failure_mid_stream_is_an_sse_error_then_done(live_server, monkeypatch):
    """A crash inside the real engine after the first tokens: error event + [DONE]; the thread survives."""
    engine = live_server.bridge.engine
    real_generate = engine.generate

    def failing_generate(req):
        steps = real_generate(req)

        def run():
            try:
                yield next(steps)
                raise RuntimeError("injected failure")
            finally:
                steps.close()  # the engine's cleanup runs now, on the engine thread

        return run()

    monkeypatch.setattr(engine, "generate", failing_generate)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", live_server.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"error"' in events[-2] and "server log" in events[-2]
    assert "injected" not in events[-2] and "RuntimeError" not in events[-2]  # no internals in the answer
    assert '"role":"assistant"' in events[0]
    r = httpx.post(live_server.base_url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "RuntimeError" not in r.text
    monkeypatch.undo()
    r = httpx.post(live_server.base_url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    assert r.status_code == 200 and live_server.bridge.alive


@pytest.mark.parametrize("path,body,error_key", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}, "error"),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 50, "ignore_eos": True, "stream": True},
     "error"),
])
def test_engine_failure_mid_stream_on_other_routes(live_server, monkeypatch, path, body, error_key):
    engine = live_server.bridge.engine
    real_generate = engine.generate

    def failing_generate(req):
        steps = real_generate(req)

        def run():
            try:
                yield next(steps)
                yield next(steps)
                raise RuntimeError("injected failure")
            finally:
                steps.close()  # the engine's cleanup runs now, on the engine thread

        return run()

    monkeypatch.setattr(engine, "generate", failing_generate)
    with httpx.stream("POST", live_server.base_url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    errors = [e for e in events if e.startswith('{"error"')]
    assert len(errors) == 1 and "server log" in errors[0] and "RuntimeError" not in errors[0]
    if path.startswith("/v1"):
        assert events[-1] == "[DONE]" and events[-2] == errors[0]
    else:  # llama.cpp's native stream has no [DONE]
        assert events[-1] == errors[0]
    monkeypatch.undo()
    assert live_server.bridge.alive
