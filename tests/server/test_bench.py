"""`spruce bench` against a real server (the tiny checkpoint behind uvicorn on 127.0.0.1)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from server.bench.records import load
from server.bench.stats import percentile
from server.cli import main

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--classes", "code", "chat", "long-4k", "--prompts-per-class", "1", "--max-tokens", "8", "--no-plots"]

# Runs the command in a fresh interpreter and reports which modules it loaded: the client must not
# load MLX or the engine (only the CLI's config constants).
CHILD = """
import json, sys
from server.cli import main
rc = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm") or m.startswith("engine."))
print("LOADED " + json.dumps({"rc": rc, "modules": loaded}))
"""


@pytest.fixture(scope="module")
def first_run(live_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    p = subprocess.run([sys.executable, "-c", CHILD, "bench", "--base-url", live_server.base_url, "--out", str(out),
                        *ARGS], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    live_server.wait_idle()
    return out, p


def test_bench_writes_json_and_markdown_without_loading_mlx(first_run, live_server):
    out, p = first_run
    report = json.loads(p.stdout.split("LOADED ", 1)[1])
    assert report["rc"] == 0, p.stderr
    # the CLI's own settings modules only (no mlx, no model code: the bench is an HTTP client), and
    # engine.precision, which importing the engine package runs (an environment default, no mlx)
    assert set(report["modules"]) <= {"engine.config", "engine.hub", "engine.precision"}, report
    result = load(out / "results.json")
    assert result.model == live_server.model_id and result.label == live_server.model_id
    assert result.settings["max_tokens"] == 8 and result.settings["context"] == 2048
    assert [c.cls for c in result.classes] == ["code", "chat", "long-4k"]
    for cls in ("code", "chat"):
        row = result.summary(cls)
        (prompt,) = [x for x in result.prompts if x.cls == cls]
        assert len(prompt.warmup) == 1 and len(prompt.runs) == 1 and prompt.error is None
        r = prompt.runs[0]
        assert 0 < r.ttft_ms <= r.total_ms and r.arrivals_ms == sorted(r.arrivals_ms)
        assert 1 <= r.completion_tokens <= 8 and r.tokens_counted == "usage"
        assert r.timings["predicted_n"] == r.completion_tokens and r.prompt_tokens > 0
        assert row.runs == 1 and row.tokens_per_forward == 1.0 and row.prefill_source == "server"
        gaps = r.gaps_ms
        assert row.itl_samples == len(gaps) == len(r.arrivals_ms) - 1
        if gaps:
            assert row.itl_p50_ms == pytest.approx(percentile(gaps, 50))
            assert row.itl_p99_ms == pytest.approx(percentile(gaps, 99))
        assert row.same_as_reference is None and row.stable is True
    long = result.summary("long-4k")
    assert long.runs == 0 and "do not fit the context of 2048 tokens" in long.note
    md = (out / "results.md").read_text()
    assert md.count("| code |") == 1 and md.count("| chat |") == 1
    assert "long-4k: skipped: about 3800 prompt + 8 new tokens" in md
    assert md in p.stdout  # the table is printed too


def test_bench_same_text_against_a_reference(first_run, live_server, tmp_path):
    out, _ = first_run
    ref = out / "results.json"
    rc = main(["bench", "--base-url", f"{live_server.base_url}/v1", "--out", str(tmp_path / "again"),
               "--reference", str(ref), "--label", "again", "--warmup", "0", *ARGS])
    assert rc == 0
    again = load(tmp_path / "again" / "results.json")
    assert again.reference == load(ref).label and again.label == "again"
    assert again.summary("code").same_as_reference == "1/1"  # greedy: the same text twice
    assert all(not p.warmup for p in again.prompts)
    doctored = json.loads(ref.read_text())
    for prompt in doctored["prompts"]:
        if prompt["cls"] == "code":
            prompt["runs"][0]["text"] += " (changed)"
    (tmp_path / "doctored.json").write_text(json.dumps(doctored))
    assert main(["bench", "--base-url", live_server.base_url, "--out", str(tmp_path / "third"), "--reference",
                 str(tmp_path / "doctored.json"), "--warmup", "0", *ARGS]) == 0
    third = load(tmp_path / "third" / "results.json")
    assert third.summary("code").same_as_reference == "0/1" and third.summary("chat").same_as_reference == "1/1"
    md = (tmp_path / "third" / "results.md").read_text()
    assert "| 0/1 |" in md and "| 1/1 |" in md


def test_bench_merge_redraws_earlier_results(first_run, tmp_path):
    out, _ = first_run
    assert main(["bench", "--merge", str(out / "results.json"), str(out / "results.json"), "--out",
                 str(tmp_path), "--no-plots"]) == 0
    md = (tmp_path / "results.md").read_text()
    assert md.count("| code |") == 2 and not (tmp_path / "results.json").exists()


def test_bench_extra_body_reaches_the_server(live_server, tmp_path):
    """A field the server rejects comes back as a recorded failure with the server's message, not a crash."""
    rc = main(["bench", "--base-url", live_server.base_url, "--out", str(tmp_path), "--classes", "code",
               "--prompts-per-class", "1", "--max-tokens", "4", "--no-plots", "--extra-body", '{"top_p": 7}'])
    assert rc == 1  # no request succeeded
    result = load(tmp_path / "results.json")
    assert result.summary("code").runs == 0 and "HTTP 400" in result.summary("code").note
    assert "top_p" in result.prompts[0].error
    live_server.wait_idle()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--base-url", f"http://127.0.0.1:{closed_port()}"], "cannot reach"),
    (["--base-url", "localhost:8000"], "must start with http"),
    (["--base-url", "http://127.0.0.1:1", "--classes", "poetry"], "unknown prompt class poetry"),
    (["--base-url", "http://127.0.0.1:1", "--extra-body", "{nope"], "--extra-body is not JSON"),
    (["--base-url", "http://127.0.0.1:1", "--runs", "0"], "--runs must be >= 1"),
    (["--merge", "/nonexistent/results.json"], "cannot read a spruce bench result"),
    ([], "pass --base-url URL"),
])
def test_bench_bad_input_is_one_clear_line(args, message, tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
