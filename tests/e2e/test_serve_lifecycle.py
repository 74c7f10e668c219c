"""`spruce serve` as an operator runs it: start-up errors before the model loads, SIGTERM / Ctrl-C
with work in flight (a final event for the running stream, 503 for the queue, exit 0 within the
shutdown timeout), no abort at exit, and slow or surplus connections turned away."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
# long enough to be running still when the grace period ends: the tiny model decodes ~5,000 tokens a
# second on the dev CPU (3,000 tokens once ran out before the signal); its server gets the context
LONG = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60000, "ignore_eos": True, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: Path, *args: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", str(port),
                             "--log-level", "warning", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


class Stream(threading.Thread):
    """A streamed chat request read on its own thread; .events holds its data payloads."""

    def __init__(self, base: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.base, self.body = base, {**body, "stream": True}
        self.events: list[str] = []
        self.error: Exception | None = None
        self.status: int | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base + "/v1/chat/completions", json=self.body, timeout=60) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
        except httpx.HTTPError as e:
            self.error = e


def wait_for(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def queued(base: str) -> int:
    return httpx.get(base + "/health", timeout=5).json()["queued"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_shutdown_with_a_running_stream_and_a_full_queue(tiny_checkpoint, sig):
    args = ("--max-queue", "2", "--shutdown-timeout", "1", "--max-context", "65536")
    with serve(tiny_checkpoint, *args) as (proc, base):
        running = Stream(base, LONG)
        running.start()
        wait_for(lambda: len(running.events) >= 3)  # role chunk and some text: it is generating
        waiting_stream = Stream(base, LONG)
        waiting_stream.start()
        waiting_plain: dict = {}
        plain = threading.Thread(target=lambda: waiting_plain.update(
            r=httpx.post(base + "/v1/chat/completions", json=LONG, timeout=60)), daemon=True)
        wait_for(lambda: queued(base) == 1)
        plain.start()
        wait_for(lambda: queued(base) == 2)
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - t0
        for t in (running, waiting_stream, plain):
            t.join(10)
    assert proc.returncode == 0, stderr
    assert "terminate called" not in stderr and "Traceback" not in stderr
    assert took < 1 + 5, took  # the grace period, plus time to stop
    # the running stream: its text so far, then an event that says why it ended, then [DONE]
    assert running.error is None and running.events[-1] == "[DONE]"
    last = json.loads(running.events[-2])["error"]
    assert last["code"] == "server_shutting_down" and "shutting down" in last["message"]
    assert len(running.events) > 4  # the role chunk, text chunks, the reason, [DONE]
    # the queued ones were never run: 503, or an error event with the same code for a stream
    assert waiting_stream.events[-1] == "[DONE]"
    assert json.loads(waiting_stream.events[-2])["error"]["code"] == "server_shutting_down"
    r = waiting_plain["r"]
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
    print(f"{sig.name}: exited 0 in {took:.2f} s with 1 stream running and 2 queued (--shutdown-timeout 1)")


def test_an_idle_server_stops_at_once_and_warns_when_exposed(tiny_checkpoint):
    with serve(tiny_checkpoint, "--host", "0.0.0.0") as (proc, _):
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0 and time.monotonic() - t0 < 3
    assert "warning: --host 0.0.0.0" in stderr and "--api-key" in stderr


def test_warmup_on_runs_before_serving_and_the_server_answers(tiny_checkpoint):
    """--warmup on (the GPU default) on the CPU: the warm-up runs before /health answers, with
    speculation configured, and requests are answered as usual afterwards."""
    with serve(tiny_checkpoint, "--warmup", "on", "--spec", "ngram") as (proc, base):
        r = httpx.post(base + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert "spruce: warm-up done in" in stderr
    assert stderr.index("warm-up done") < stderr.index("serving")


def test_a_model_that_fails_to_load_exits_2_without_an_abort(tiny_checkpoint, tmp_path):
    """Weights load, then the tokenizer fails: the half-built model must be freed before exit
    (freed during interpreter exit, MLX aborted: "terminate called without an active exception")."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_checkpoint.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "tokenizer.json").write_text('{"bad": 1}')
    for _ in range(4):  # the abort came in about two runs of three
        p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(broken), "--port",
                            str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "terminate called" not in p.stderr, (p.returncode, p.stderr)
        assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "cannot load model" in p.stderr


def test_a_port_in_use_is_found_before_the_model_loads(tiny_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_checkpoint), "--port",
                            str(port)], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "SPRUCE_NO_BLAS_PRELOAD": "1"})
    assert p.returncode == 2 and "already in use" in p.stderr and "serving" not in p.stderr, p.stderr
    assert time.monotonic() - t0 < 30


def raw_connection(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")  # and never the rest
    return s


def closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_slow_clients_are_cut_and_surplus_connections_refused(tiny_checkpoint):
    with serve(tiny_checkpoint, "--read-timeout", "1", "--max-connections", "6") as (proc, base):
        port = int(base.rsplit(":", 1)[1])
        slow = [raw_connection(port) for _ in range(6)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        assert all(closed_within(s, 5) for s in slow)  # their heads never came: closed after 1 s
        # a body that stops halfway gets 408
        r = socket.create_connection(("127.0.0.1", port), timeout=10)
        r.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        reply = b""
        while chunk := r.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 200  # everyone else is served
        for s in (*slow, extra, r):
            s.close()
