"""scripts/load_test.py in small: mixed concurrent traffic against a real `spruce serve` subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_small_load_run_keeps_the_server_healthy(tiny_checkpoint, tmp_path):
    out = tmp_path / "load.json"
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "load_test.py"), "--model", str(tiny_checkpoint),
                        "--requests", "40", "--clients", "4", "--time-limit", "60", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert data["requests"] == 40 and data["skipped"] == 0
    assert all(data["checks"].values())
    assert set(data["outcomes"]) <= {"ok", "rejected_400", "busy_429", "cancelled_by_client"}
    assert data["outcomes"]["ok"] > 0 and data["outcomes"].get("rejected_400", 0) > 0
    assert "latency of ok requests: p50" in p.stdout and "server RSS" in p.stdout


def test_load_test_fails_when_memory_grows_past_the_bound(tiny_checkpoint):
    """A bound below any real growth (negative) must make the run fail: the check is live."""
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "load_test.py"), "--model", str(tiny_checkpoint),
                        "--requests", "8", "--clients", "2", "--max-rss-growth-mb", "-1000"],
                       cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert p.returncode == 1 and "check memory growth within bound: FAILED" in p.stdout
