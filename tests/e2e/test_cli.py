"""The `spruce` CLI as a user runs it: a subprocess from the repository root."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STATS = {
    "time to first token": r"[\d.]+ s",
    "prefill speed": r"[\d.]+ t/s",
    "generation speed": r"[\d.]+ t/s",
    "tokens per forward pass": r"[\d.]+ t/f",
    "memory used": r"[\d.]+ GB",
    "duration": r"[\d.]+ s",
}


def spruce(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_run_streams_answer_and_prints_stats(tiny_checkpoint):
    p = spruce("run", "--model", str(tiny_checkpoint), "-m", "hi", "--max-tokens", "8")
    assert p.returncode == 0, p.stderr
    assert p.stdout.endswith("\n") and p.stdout.strip()
    for name, value in STATS.items():
        assert re.search(rf"^{name}: {value}$", p.stderr, re.MULTILINE), f"missing {name!r} in {p.stderr!r}"
    assert "Traceback" not in p.stderr


def test_run_is_deterministic_and_matches_the_engine(tiny_checkpoint):
    """Greedy `run` prints exactly what the engine produces for the chat-rendered prompt (thinking off)."""
    from engine.config import EngineConfig, SamplingParams
    from engine.generate import Engine
    from engine.types import GenerationRequest
    from server.chat import ChatRenderOptions, ChatTemplate

    engine = Engine(EngineConfig(model_path=str(tiny_checkpoint)))
    tok = engine.tokenizer
    prompt = ChatTemplate(tok.chat_template).render([{"role": "user", "content": "hi"}],
                                                    ChatRenderOptions(enable_thinking=False))
    req = GenerationRequest(prompt_ids=tok.encode(prompt),
                            sampling=SamplingParams(max_tokens=8, stop_token_ids=tok.eos_token_ids))
    ids = [t for step in engine.generate(req) for t in step.token_ids]
    p = spruce("run", "--model", str(tiny_checkpoint), "-m", "hi", "--max-tokens", "8")
    assert p.stdout == tok.decode(ids) + "\n"


def test_bad_model_path_is_one_line_and_exit_2(tmp_path):
    for model in (tmp_path / "missing", tmp_path):
        p = spruce("run", "--model", str(model), "-m", "hi")
        assert p.returncode == 2
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and str(model.name) in lines[0] and "Traceback" not in p.stderr


def test_broken_checkpoint_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "nonsense"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    p = spruce("run", "--model", str(tmp_path), "-m", "hi")
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "cannot load model" in p.stderr


def test_no_prompt_and_bad_values_are_clear_errors(tiny_checkpoint):
    p = subprocess.run([sys.executable, "-m", "server.cli", "run", "--model", str(tiny_checkpoint)], cwd=REPO,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60, check=False)
    assert p.returncode == 2 and "no prompt" in p.stderr
    p = subprocess.run([sys.executable, "-m", "server.cli", "run", "--model", str(tiny_checkpoint), "--max-tokens",
                        "2"], cwd=REPO, capture_output=True, text=True, input="hello from stdin", timeout=60,
                       check=False)
    assert p.returncode == 0 and "generation speed" in p.stderr
    assert "finish reason: length" in p.stderr and "generated tokens: 2" in p.stderr
    p = spruce("run", "--model", str(tiny_checkpoint), "-m", "hi", "--temperature", "-1")
    assert p.returncode == 2 and "temperature" in p.stderr and "Traceback" not in p.stderr


def test_serve_answers_http(tiny_checkpoint):
    """`spruce serve` with an API key from SPRUCE_API_KEY and one CORS origin."""
    import os
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "SPRUCE_API_KEY": "test-key"}
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_checkpoint), "--port",
                             str(port), "--max-context", "256", "--log-level", "warning", "--cors-origin",
                             "http://editor.example"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    auth = {"Authorization": "Bearer test-key"}
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(base + "/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(base + "/v1/models", headers=auth).json()["data"][0]["max_model_len"] == 256
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 401  # env key
        preflight = httpx.options(base + "/v1/chat/completions", headers={
            "Origin": "http://editor.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == "http://editor.example"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_no_bundled_model_message(monkeypatch, tmp_path, capsys):
    from engine import presets
    from server import cli

    monkeypatch.setattr(presets, "bundled_path", lambda model: tmp_path / "bundled" / "target")
    assert cli.main(["run", "-m", "hi"]) == 2
    assert "no bundled model in this install; pass --model DIR" in capsys.readouterr().err


def test_leave_flushes_what_was_written_and_exits_with_the_code():
    # the command line ends through os._exit (server.cli.leave: OpenBLAS's exit handler could hang);
    # a pipe's buffered output must still reach the reader
    code = ("import sys; from server.cli import leave; print('answer', end=''); "
            "sys.stderr.write('stats'); leave(7)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (7, "answer", "stats")


def test_ctrl_c_in_run_exits_130_without_a_traceback():
    """Interrupted mid-answer (the bundled model: a forward pass long enough that the interruption
    lands inside the engine's loop; five times, as it can land anywhere). --ignore-eos: a story
    that ends before the interruption lands would exit 0. Before `leave`, 4 of 40 such runs in a
    fresh install on a busy dev CPU hung in OpenBLAS's exit handler."""
    import signal
    import threading

    for _ in range(5):
        p = subprocess.Popen([sys.executable, "-m", "server.cli", "run", "-m", "Write a long story",
                              "--max-tokens", "3000", "--temperature", "0", "--ignore-eos"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             # a runner started in the background (`cmd &`) ignores SIGINT, and the
                             # child would inherit that: Python then installs no Ctrl-C handler
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        started = threading.Event()
        reader = threading.Thread(target=lambda: (p.stdout.read(20), started.set(), p.stdout.read()), daemon=True)
        reader.start()
        assert started.wait(60), "no answer text"
        p.send_signal(signal.SIGINT)
        stderr = p.stderr.read()
        p.wait(60)
        assert p.returncode == 130 and "Traceback" not in stderr and "terminate called" not in stderr, stderr


def test_engine_flag_checks(tiny_checkpoint, tmp_path):
    for args, message in ((["--draft-model", str(tmp_path / "nope")], "--draft-model"),
                          (["--prefix-cache-bytes", "-1"], "--prefix-cache-bytes"),
                          (["--spec-budget", "0"], "--spec-budget"), (["--max-context", "1"], "--max-context")):
        p = spruce("run", "--model", str(tiny_checkpoint), "-m", "hi", *args)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
        assert "--model " not in p.stderr.replace(f"--model {tiny_checkpoint}", "")


def test_temperature_nan_is_refused(tiny_checkpoint):
    p = spruce("run", "--model", str(tiny_checkpoint), "-m", "hi", "--temperature", "nan")
    assert p.returncode == 2 and "temperature" in p.stderr and "Traceback" not in p.stderr


def test_max_context_defaults_to_the_trained_length(tiny_checkpoint):
    from server.cli import build_parser, engine_config

    trained = json.loads((tiny_checkpoint / "config.json").read_text())["max_position_embeddings"]
    assert trained < 8192
    parse = build_parser().parse_args
    assert engine_config(parse(["run", "--model", str(tiny_checkpoint)])).config.max_context == trained
    asked = engine_config(parse(["run", "--model", str(tiny_checkpoint), "--max-context", "100"]))
    assert asked.config.max_context == 100
    longer = engine_config(parse(["run", "--model", str(tiny_checkpoint), "--max-context", str(2 * trained)]))
    assert any(f"longer than the {trained} tokens the model was trained on" in n for n in longer.notes)


def test_a_broken_draft_model_is_found_at_start(tiny_checkpoint, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_text"}')
    (tmp_path / "tokenizer.json").write_text((tiny_checkpoint / "tokenizer.json").read_text())
    p = spruce("serve", "--model", str(tiny_checkpoint), "--draft-model", str(tmp_path), "--port", "0")
    assert p.returncode == 2 and "cannot load the draft model" in p.stderr and "serving" not in p.stderr


def test_ignore_eos_generates_max_tokens():
    """The bundled model's greedy answer to a greeting ends early; --ignore-eos goes on to
    --max-tokens, past the end-of-text token."""
    p = spruce("run", "-m", "hi", "--temperature", "0", "--max-tokens", "300", "--ignore-eos")
    assert p.returncode == 0 and "finish reason: length" in p.stderr and "generated tokens: 300" in p.stderr, p.stderr
