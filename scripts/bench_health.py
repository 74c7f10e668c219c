"""/health latency while one large request at a time is handled, and the server's memory after.

    python scripts/bench_health.py                                   # the bundled model
    python scripts/bench_health.py --checkout OTHER_TREE             # the same against another checkout

A real `spruce serve` subprocess; a separate process asks /health every 20 ms on its own
connection. Phases, each one request after the other: the largest text /tokenize accepts (the
context's worth of bytes at the tokenizer's longest token), the same size as a chat message, a
chat of as many small messages as the JSON item limit lets in, /detokenize of a context of ids, a
16 MB prompt (refused by its length), and a 16 MB /tokenize. For each: the request's own time and
status, and /health p50 / p99 / max while it ran. Server RSS before and after all of it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import free_port, percentile, rss_mb, wait_healthy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server.service import JSON_ITEMS_BASE  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "engine" / "bundled" / "target"
EVERY_S = 0.02


def probe(base: str, stop, out) -> None:
    """(time sent, seconds to answer) of every /health, -1 for a failure."""
    samples = []
    with httpx.Client(base_url=base, timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = client.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            samples.append((t0, time.perf_counter() - t0 if ok else -1.0))
            stop.wait(EVERY_S)
    out.send(samples)


def phases(context: int, max_token_bytes: int) -> list[tuple[str, str, dict]]:
    accepted = (context - 1) * max_token_bytes - 200  # under the bound of Tokenizer.max_text_bytes, with the template
    items = JSON_ITEMS_BASE + 4 * context
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(items // 4 - 16)]
    return [
        ("largest accepted /tokenize", "/tokenize", {"content": "ab " * (accepted // 3)}),
        ("chat text at the byte bound", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "ab " * (accepted // 3)}], "max_tokens": 1}),
        (f"chat of {len(many)} messages", "/v1/chat/completions", {"messages": many, "max_tokens": 1}),
        (f"/detokenize of {context} ids", "/detokenize", {"tokens": [100 + i % 1000 for i in range(context)]}),
        ("16 MB prompt", "/v1/completions", {"prompt": "word " * (16_000_000 // 5), "max_tokens": 1}),
        ("16 MB /tokenize", "/tokenize", {"content": "x" * 16_000_000}),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--checkout", default=str(REPO), help="the source tree whose server to run")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args(argv)
    from engine.tokenizer import Tokenizer  # no mlx: the bound the server uses

    tok = Tokenizer.from_dir(args.model)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", args.model, "--port", str(port),
                             "--max-context", str(args.max_context), "--log-level", "warning"], cwd=args.checkout,
                            env={**os.environ, "PYTHONPATH": args.checkout},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ctx = multiprocessing.get_context("spawn")
    stop, (receive, send) = ctx.Event(), ctx.Pipe(duplex=False)
    results = []
    try:
        wait_healthy(proc, base, 120)
        httpx.post(base + "/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=60)
        rss_before = rss_mb(proc.pid)
        prober = ctx.Process(target=probe, args=(base, stop, send), daemon=True)
        prober.start()
        time.sleep(1)
        spans = []
        with httpx.Client(base_url=base, timeout=300) as client:
            for name, path, body in phases(args.max_context, tok.max_token_bytes):
                raw = json.dumps(body).encode()
                t0 = time.perf_counter()
                try:
                    status = client.post(path, content=raw, headers={"content-type": "application/json"}).status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                t1 = time.perf_counter()
                spans.append((name, t0, t1, status, len(raw)))
                time.sleep(0.5)
        time.sleep(1)
        rss_after = rss_mb(proc.pid)
        stop.set()
        samples = receive.recv()
        prober.join(30)
    finally:
        stop.set()
        proc.terminate()
        proc.communicate(timeout=60)
    for name, t0, t1, status, size in spans:  # the /health requests that overlap the phase
        during = sorted(d for t, d in samples if d >= 0 and t <= t1 and t + d >= t0)
        failed = sum(1 for t, d in samples if d < 0 and t0 <= t <= t1)
        row = {"phase": name, "status": status, "body_mb": size / 1e6, "request_s": t1 - t0, "health_n": len(during),
               "health_failed": failed, "health_p50_ms": percentile(during, 0.5) * 1e3,
               "health_p99_ms": percentile(during, 0.99) * 1e3, "health_max_ms": (during[-1] if during else 0) * 1e3}
        results.append(row)
        print(f"{name:32s} HTTP {status}, {size / 1e6:6.2f} MB body, {t1 - t0:6.2f} s; /health n={len(during)} "
              f"p50 {row['health_p50_ms']:.1f} ms p99 {row['health_p99_ms']:.1f} ms max {row['health_max_ms']:.1f} ms"
              + (f", {failed} failed" if failed else ""))
    every = sorted(d for _, d in samples if d >= 0)
    print(f"all /health answers: n={len(every)}, p50 {percentile(every, 0.5) * 1e3:.1f} ms, "
          f"p99 {percentile(every, 0.99) * 1e3:.1f} ms, max {every[-1] * 1e3:.1f} ms")
    print(f"server RSS: {rss_before:.0f} MB before, {rss_after:.0f} MB after")
    if args.json:
        Path(args.json).write_text(json.dumps({"phases": results, "rss_before_mb": rss_before,
                                               "rss_after_mb": rss_after}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
