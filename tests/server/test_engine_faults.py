"""Engine faults never leave a client waiting: a failing request gets 500 (OpenAI's shape) and the
engine thread serves the next one; if the thread ends anyway, the running and queued clients get
an answer, new requests get 503 and /health says so.

Each test runs a private engine thread over the tiny checkpoint (the faults are injected into
its real Engine), behind the real app in-process.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from engine.config import EngineConfig
from engine.generate import Engine
from server.app import create_app
from server.bridge import EngineBridge

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
ANSWER_S = 30  # a hung client fails the test instead of hanging it


class EngineDeath(BaseException):
    """Not an Exception: it gets past the per-request handler and ends the engine thread."""


@pytest.fixture
def private(tiny_checkpoint):
    config = EngineConfig(model_path=str(tiny_checkpoint), max_context=512)
    bridge = EngineBridge(lambda: Engine(config), max_queue=4)
    bridge.start()
    yield bridge
    bridge.stop()


def run(bridge: EngineBridge, scenario):
    """scenario(client) on a fresh event loop with an ASGI client over the app."""
    app = create_app(bridge)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost",
                                     timeout=ANSWER_S) as client:
            return await asyncio.wait_for(scenario(client), ANSWER_S)

    return asyncio.run(go())


def assert_server_error(r: httpx.Response, status: int = 500) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == {500: "server_error", 503: "unavailable_error"}[status]
    return err


def fail_eagerly(engine, exc: BaseException, times: int = 1):
    """engine.generate raises `exc` before its first step (as a failing draft-model load does),
    the first `times` calls; later calls run the real engine."""
    real = engine.generate
    calls = []

    def generate(req, drafter=None):
        calls.append(req.request_id)
        if len(calls) <= times:
            raise exc
        return real(req)

    engine.generate = generate
    return calls


@pytest.mark.parametrize("exc", [RuntimeError("boom"), MemoryError(), KeyError("draft")],
                         ids=["RuntimeError", "MemoryError", "KeyError"])
def test_eager_engine_error_is_500_and_the_engine_serves_on(private, exc):
    fail_eagerly(private.engine, exc)

    async def scenario(client):
        first = await client.post(CHAT, json=BODY)
        second = await client.post(CHAT, json=BODY)
        health = await client.get("/health")
        return first, second, health

    first, second, health = run(private, scenario)
    err = assert_server_error(first)
    assert "server log" in err["message"] and type(exc).__name__ not in err["message"]
    assert second.status_code == 200 and second.json()["usage"]["completion_tokens"] == 4
    assert health.status_code == 200 and private.alive


def test_eager_error_in_a_stream_is_an_error_event_then_done(private):
    fail_eagerly(private.engine, RuntimeError("boom"))

    async def scenario(client):
        async with client.stream("POST", CHAT, json={**BODY, "stream": True}) as r:
            return r.status_code, [line async for line in r.aiter_lines() if line.startswith("data: ")]

    status, events = run(private, scenario)
    assert status == 200 and events[-1] == "data: [DONE]"
    assert '"type":"server_error"' in events[-2] and "boom" not in events[-2]


def test_queued_clients_are_served_after_a_failure(private):
    """The failing job is the running one; the ones queued behind it still get their answers."""
    calls = fail_eagerly(private.engine, RuntimeError("boom"))

    async def scenario(client):
        return await asyncio.gather(*(client.post(CHAT, json=BODY) for _ in range(3)))

    answers = run(private, scenario)
    assert sorted(r.status_code for r in answers) == [200, 200, 500] and len(calls) == 3


def test_a_dead_engine_thread_answers_everyone_and_health_says_so(private):
    """The thread ends (an error that is not an Exception) while one job runs and two wait: all
    three get an answer, later requests get 503, /health 503."""
    engine = private.engine
    real = engine.generate

    def generate(req, drafter=None):
        steps = real(req)

        def run_then_die():
            try:
                yield next(steps)
                while len(private.waiting()) < 2:  # the other two are queued behind this one
                    time.sleep(0.01)
                raise EngineDeath("the thread ends here")
            finally:
                steps.close()

        return run_then_die()

    engine.generate = generate

    async def scenario(client):
        async def one(i):
            if i:
                await asyncio.sleep(0.2 * i)  # queued in order behind the first
            return await client.post(CHAT, json={**BODY, "max_tokens": 50})

        answers = await asyncio.gather(*(one(i) for i in range(3)))
        return answers, await client.post(CHAT, json=BODY), await client.get("/health")

    (running, *queued), later, health = run(private, scenario)
    assert_server_error(running, 500)
    for r in queued:
        assert_server_error(r, 503)
    assert assert_server_error(later, 503)["code"] == "unavailable"
    err = assert_server_error(health, 503)
    assert err["code"] == "engine_stopped" and not private.alive and private.status == "stopped"
