"""scripts/bench_peers.py in small: Spruce servers started and stopped one at a time on the tiny
checkpoint, engines that cannot run here reported as such, and the goal check."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from server.bench.records import ClassSummary, EngineResult, load

REPO = Path(__file__).resolve().parents[2]


def bench_peers_module():
    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_peers", REPO / "scripts" / "bench_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_peers_runs_each_engine_in_turn(tiny_checkpoint, tmp_path):
    out = tmp_path / "peers"
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_peers.py"), "--model", str(tiny_checkpoint),
                        "--out", str(out), "--engines", "spruce-none,spruce-ngram", "spruce-draft", "llama.cpp",
                        "--classes", "code", "long-16k", "--prompts-per-class", "1", "--max-tokens", "6",
                        "--llama-server", str(tmp_path / "no-such-llama-server"), "--no-plots"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    none, ngram = load(out / "engines" / "spruce-none.json"), load(out / "engines" / "spruce-ngram.json")
    assert none.summary("code").runs == 1 and ngram.summary("code").runs == 1
    assert ngram.reference == "spruce-none" and ngram.summary("code").same_as_reference == "1/1"  # lossless
    assert none.engine_info["weights"] == "float32 file, f32 compute" and "--spec none" in none.engine_info["command"]
    assert str(tmp_path) not in none.engine_info["command"]  # no machine paths in reports
    assert "do not fit the context" in none.summary("long-16k").note
    draft = load(out / "engines" / "spruce-draft.json")
    assert draft.skipped.startswith("no draft model for this checkpoint")
    assert "no llama-server binary" in load(out / "engines" / "llama.cpp.json").skipped
    md = (out / "results.md").read_text()
    assert md.count("| code |") == 2 and "- llama.cpp: not run: no llama-server binary" in md
    # (the verdict itself needs decode speeds, which this random model's byte soup may not give: the
    # goal check's logic is tested on made-up results below)
    assert "## Goal check (code prompts)" in md
    assert (out / "logs" / "spruce-none.log").is_file()


def summary(label: str, decode: float, p99: float, same: str | None = "1/1") -> EngineResult:
    row = ClassSummary("code", 1, 1, decode_tps=decode, itl_p99_ms=p99, same_as_reference=same)
    return EngineResult(label=label, base_url="", model=None, date="", machine="", settings={}, classes=[row])


def test_goal_check_verdicts():
    goal_check = bench_peers_module().goal_check
    text = goal_check([summary("spruce-none", 100.0, 12.0, None), summary("spruce-ngram", 150.0, 30.0),
                       summary("mlx-lm", 120.0, 10.0, "0/1")])
    assert "best configuration: spruce-ngram, 150.0 tok/s" in text
    assert "vs mlx-lm: 120.0 tok/s, ratio 1.25x (same text: 0/1)" in text
    assert "Highest decode tok/s of the engines: yes." in text
    assert "30.0 ms vs plain decoding's 12.0 ms: no worse: no." in text
    slower = goal_check([summary("spruce-none", 100.0, 12.0, None), summary("mlx-lm", 120.0, 10.0)])
    assert "Highest decode tok/s of the engines: no." in slower and "no worse: yes." in slower
