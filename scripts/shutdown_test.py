"""Shutdown under load: a real `spruce serve` with one long stream running and a full queue (streams
and non-streamed requests) gets SIGTERM or SIGINT; how long until the process is gone, and what
each client got.

    python scripts/shutdown_test.py                       # the tiny random checkpoint
    python scripts/shutdown_test.py --model engine/bundled/target --runs 3 --shutdown-timeout 5

Every run must end with exit code 0, no abort, the running stream ending with an error event that
says the server is shutting down and then [DONE], and every queued request answered with 503 (an
error event with the same code for a stream). The exit status is non-zero otherwise.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import free_port, make_tiny, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LONG = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 4000, "ignore_eos": True,
        "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}


class Client(threading.Thread):
    """One request; keeps the HTTP status and the SSE data payloads (or the JSON error body)."""

    def __init__(self, base: str, stream: bool) -> None:
        super().__init__(daemon=True)
        self.base, self.stream = base, stream
        self.status: int | None = None
        self.events: list[str] = []
        self.error: str | None = None

    def run(self) -> None:
        body = {**LONG, "stream": self.stream}
        try:
            with httpx.stream("POST", self.base + "/v1/chat/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                if not self.stream:
                    r.read()
                    self.events.append(r.text)
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
        except httpx.HTTPError as e:
            self.error = repr(e)

    def outcome(self) -> str:
        if self.error:
            return f"transport error {self.error}"
        if not self.stream:
            return f"HTTP {self.status} {json.loads(self.events[0]).get('error', {}).get('code')}"
        if not self.events or self.events[-1] != "[DONE]":
            return "stream cut without [DONE]"
        last = json.loads(self.events[-2]) if len(self.events) > 1 else {}
        return f"stream of {len(self.events) - 2} chunks, then error {last.get('error', {}).get('code')} + [DONE]"

    def ok(self, running: bool) -> bool:
        if not self.stream:
            return self.status == 503
        want = "server_shutting_down"
        good = self.error is None and self.events[-1:] == ["[DONE]"] and want in self.events[-2]
        return good and (not running or len(self.events) > 3)


def one_run(model: Path, args, sig: signal.Signals) -> tuple[float, bool, list[str]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", str(port),
                             "--max-queue", str(args.queue), "--shutdown-timeout", str(args.shutdown_timeout),
                             "--log-level", "warning"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_healthy(proc, base, 120)
        running = Client(base, stream=True)
        running.start()
        while len(running.events) < 3:
            time.sleep(0.02)
        waiting = [Client(base, stream=i % 2 == 0) for i in range(args.queue)]
        for i, client in enumerate(waiting):
            client.start()
            while httpx.get(base + "/health", timeout=10).json()["queued"] < i + 1:
                time.sleep(0.02)
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    for c in (running, *waiting):
        c.join(30)
    good = (proc.returncode == 0 and "terminate called" not in stderr and running.ok(True)
            and all(c.ok(False) for c in waiting))
    lines = [f"exit code {proc.returncode}", f"running: {running.outcome()}"]
    lines += [f"queued {'stream' if c.stream else 'plain '}: {c.outcome()}" for c in waiting]
    return took, good, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: a tiny random checkpoint made in a temp dir)")
    ap.add_argument("--runs", type=int, default=2, help="runs per signal")
    ap.add_argument("--queue", type=int, default=4, help="--max-queue of the server (all filled)")
    ap.add_argument("--shutdown-timeout", type=float, default=5.0)
    args = ap.parse_args(argv)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else make_tiny(Path(tmp))
        for sig in (signal.SIGTERM, signal.SIGINT):
            times = []
            for i in range(args.runs):
                took, good, lines = one_run(model, args, sig)
                times.append(took)
                failed |= not good
                verdict = "ok" if good else "FAILED"
                print(f"{sig.name} run {i + 1}: {took:.2f} s to exit, {verdict}; " + "; ".join(lines))
            print(f"{sig.name}: median {statistics.median(times):.2f} s, max {max(times):.2f} s to exit with 1 stream "
                  f"running and {args.queue} queued (--shutdown-timeout {args.shutdown_timeout:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
