"""Load test: a real `spruce serve` subprocess on 127.0.0.1 under mixed concurrent traffic.

    python scripts/load_test.py                      # the tiny random checkpoint, 240 requests, 8 clients
    python scripts/load_test.py --model DIR --requests 400 --clients 16

Traffic: chat and legacy completions, streamed and not, /infill, logprobs / n=2 / tools, streams
the client drops midway, streams read by a slow reader, non-streamed requests it abandons, long
prompts, prompts of megabytes (refused by their length: 400) and invalid bodies (which must get a
400). The server's queue is small, so some requests meet a full queue (429 with Retry-After).
The run is bounded in requests and in time, and stops by itself. Meanwhile a separate process
asks /health every 50 ms and records how long each answer took.

Afterwards the server must still be healthy and give the same greedy answer as before the load;
its resident memory (/proc/PID/status VmRSS, after a warm-up vs after the load) must not grow by
more than --max-rss-growth-mb. The exit status is non-zero if any of that fails, or if any
request ended in an unexpected way (5xx, transport error, a broken stream, a wrong status), or
if /health failed to answer.

    python scripts/load_test.py --model engine/bundled/target --clients 32 --requests 100000 --time-limit 120
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
EXPECTED = {"ok", "rejected_400", "busy_429", "cancelled_by_client"}
MAX_RETRIES = 30
MSG = [{"role": "user", "content": "Write a short poem about spruce trees."}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
PROBE = {"messages": MSG, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **OFF}
INVALID = [
    {"messages": []}, {"messages": "hi"}, {"messages": MSG, "temperature": 9}, {"messages": MSG, "max_tokens": -1},
    {"messages": MSG, "top_logprobs": 3}, {"messages": MSG, "tools": [{"type": "function"}]},
    {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": MSG, "n": 0},
    {"messages": MSG, "response_format": {"type": "sound"}}, {"messages": [{"role": "user", "content": "x" * 200_000}]},
]
HUGE_PROMPT_CHARS = 8 << 20  # far past any context: refused by its length, before tokenizing
HEALTH_EVERY_S = 0.05


@dataclass
class Result:
    kind: str
    outcome: str
    latency_s: float
    detail: str = ""
    busy_answers: int = 0  # 429s met (and retried) on the way


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)
    skipped: int = 0
    rss_trace: list[tuple[int, float]] = field(default_factory=list)  # (requests done, server RSS MB)
    health_s: list[float] = field(default_factory=list)  # /health answer times during the load
    health_failures: int = 0

    def outcomes(self) -> Counter:
        return Counter(r.outcome for r in self.results)

    def unexpected(self) -> list[Result]:
        return [r for r in self.results if r.outcome not in EXPECTED]

    def latencies(self, direct_only: bool = False) -> list[float]:
        """Seconds from first send to last byte of the ok requests (direct: never answered 429)."""
        return sorted(r.latency_s for r in self.results if r.outcome == "ok" and not (direct_only and r.busy_answers))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


# ---------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", str(port),
           "--max-context", str(args.max_context), "--max-queue", str(args.server_max_queue),
           "--prefix-cache-bytes", str(args.prefix_cache_mb << 20), "--log-level", "warning"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited during startup: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("server did not become healthy")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


# ---------------------------------------------------------------- traffic


def plan_requests(n: int, rng: random.Random, long_prompt_chars: int) -> list[tuple[str, dict]]:
    kinds = ["chat", "chat_stream", "completion", "completion_stream", "infill", "extras", "cancel_stream",
             "slow_stream", "abandon", "long_prompt", "huge", "invalid"]
    weights = [16, 16, 8, 8, 10, 8, 10, 8, 5, 3, 2, 13]
    out = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        out.append((kind, request_body(kind, rng, long_prompt_chars)))
    return out


def request_body(kind: str, rng: random.Random, long_prompt_chars: int = 8000) -> dict:
    tokens = rng.randint(1, 48)
    if kind in ("chat", "chat_stream"):
        return {"messages": MSG, "max_tokens": tokens, "temperature": rng.choice([0, 0.7, 1.0]),
                "stream": kind == "chat_stream", "stop": rng.choice([None, ["\n\n"], ["a", "b", "c", "d", "e"]])}
    if kind in ("completion", "completion_stream"):
        return {"prompt": "def fibonacci(n):\n", "max_tokens": tokens, "stream": kind == "completion_stream",
                "suffix": rng.choice([None, "\n    return a\n"])}
    if kind == "infill":
        return {"input_prefix": "import os\n\ndef main():\n    ", "input_suffix": "\n\nmain()\n", "n_predict": tokens,
                "input_extra": [{"filename": "util.py", "text": "def helper():\n    pass\n"}], "n_indent": 4}
    if kind == "extras":
        return rng.choice([
            {"messages": MSG, "max_tokens": tokens, "logprobs": True, "top_logprobs": 5, "stream": True},
            {"messages": MSG, "max_tokens": 8, "n": 2, "seed": rng.randint(0, 1000)},
            {"messages": MSG, "max_tokens": tokens, "tools": [{"type": "function", "function": {
                "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
             "tool_choice": rng.choice(["auto", "required", {"type": "function",
                                                             "function": {"name": "get_weather"}}])}])
    if kind in ("cancel_stream", "abandon"):
        return {"messages": MSG, "max_tokens": 2000, "ignore_eos": True, "stream": kind == "cancel_stream", **OFF}
    if kind == "slow_stream":
        return {"messages": MSG, "max_tokens": rng.randint(4, 12), "stream": True, **OFF}
    if kind == "long_prompt":  # near the context: a long prefill
        text = "".join(rng.choice("abcdefgh ") for _ in range(long_prompt_chars))
        return {"prompt": text, "max_tokens": 4}
    if kind == "huge":
        return {"prompt": "word " * (HUGE_PROMPT_CHARS // 5), "max_tokens": 4}
    return rng.choice(INVALID)


def path_of(kind: str, body: dict) -> str:
    if kind == "infill":
        return "/infill"
    return "/v1/completions" if "prompt" in body else "/v1/chat/completions"


async def run_one(client: httpx.AsyncClient, kind: str, body: dict, rng: random.Random) -> Result:
    """One request; a 429 is retried after its Retry-After (as the OpenAI SDK does), a few times."""
    t0 = time.perf_counter()
    busy = 0
    while True:
        try:
            outcome, detail = await _exchange(client, kind, body, rng)
        except httpx.TimeoutException as e:
            outcome, detail = ("cancelled_by_client", "") if kind == "abandon" else ("timeout", repr(e))
        except httpx.TransportError as e:
            outcome, detail = "transport_error", repr(e)
        except ValueError as e:  # a body or an event that is not JSON
            outcome, detail = "bad_json", repr(e)
        if outcome != "busy_429" or busy >= MAX_RETRIES:
            return Result(kind, outcome, time.perf_counter() - t0, detail, busy)
        busy += 1
        await asyncio.sleep(float(detail) * rng.uniform(0.5, 1.0))


async def _exchange(client: httpx.AsyncClient, kind: str, body: dict, rng: random.Random) -> tuple[str, str]:
    path = path_of(kind, body)
    if kind == "abandon":  # the client gives up on a long non-streamed answer
        r = await client.post(path, json=body, timeout=httpx.Timeout(60, read=rng.uniform(0.1, 0.5)))
        return _status_outcome(r, kind)
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _status_outcome(r, kind)
            return await _read_stream(r, kind, rng)
    r = await client.post(path, json=body)
    outcome, detail = _status_outcome(r, kind)
    if outcome == "ok":
        data = r.json()
        ok = isinstance(data.get("content"), str) if kind == "infill" else all(
            c.get("finish_reason") in ("stop", "length", "tool_calls") for c in data["choices"])
        return ("ok", "") if ok else ("bad_body", r.text[:200])
    return outcome, detail


async def _read_stream(r: httpx.Response, kind: str, rng: random.Random) -> tuple[str, str]:
    cut_after = rng.randint(1, 6) if kind == "cancel_stream" else None
    events, finishes = 0, 0
    async for line in r.aiter_lines():
        if kind == "slow_stream":  # a reader slower than the server writes
            await asyncio.sleep(rng.uniform(0.02, 0.1))
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return ("ok", "") if finishes >= 1 else ("bad_stream", "no finish_reason before [DONE]")
        event = json.loads(line[6:])
        if "error" in event:
            return "stream_error_event", line[:200]
        finishes += sum(1 for c in event.get("choices", []) if c.get("finish_reason"))
        events += 1
        if cut_after is not None and events >= cut_after:
            return "cancelled_by_client", ""  # leaving the block closes the connection
    return "bad_stream", "ended without [DONE]"


def _status_outcome(r: httpx.Response, kind: str) -> tuple[str, str]:
    if r.status_code == 200:
        return "ok", ""
    if r.status_code == 429 and r.headers.get("retry-after", "").isdigit():
        return "busy_429", r.headers["retry-after"]
    if r.status_code == 400 and kind in ("invalid", "huge") and "error" in r.json():
        return "rejected_400", ""
    return f"http_{r.status_code}", r.text[:200]


async def drive(base: str, plan: list[tuple[str, dict]], clients: int, deadline: float, seed: int,
                pid: int | None = None) -> Report:
    report = Report()
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            while not queue.empty():
                kind, body = queue.get_nowait()
                if time.monotonic() > deadline:
                    report.skipped += 1
                    continue
                report.results.append(await run_one(client, kind, body, rng))

    async def sample_rss() -> None:
        while pid is not None:
            report.rss_trace.append((len(report.results), rss_mb(pid)))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample_rss())
    await asyncio.gather(*(worker(i) for i in range(clients)))
    sampler.cancel()
    return report


def probe_health(base: str, stop, out) -> None:
    """In its own process (the load's client code does not delay it): /health every 50 ms on one
    keep-alive connection; -> answer times in seconds, or -1 for a failure."""
    times = []
    with httpx.Client(base_url=base, timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = client.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            times.append(time.perf_counter() - t0 if ok else -1.0)
            stop.wait(HEALTH_EVERY_S)
    out.send(times)


def drive_with_health_probe(base: str, plan, clients: int, deadline: float, seed: int, pid: int) -> Report:
    ctx = multiprocessing.get_context("spawn")
    stop, (receive, send) = ctx.Event(), ctx.Pipe(duplex=False)
    prober = ctx.Process(target=probe_health, args=(base, stop, send), daemon=True)
    prober.start()
    try:
        report = asyncio.run(drive(base, plan, clients, deadline, seed, pid))
    finally:
        stop.set()
    times = receive.recv()
    prober.join(30)
    report.health_s = sorted(t for t in times if t >= 0)
    report.health_failures = sum(1 for t in times if t < 0)
    return report


def rss_curve(trace: list[tuple[int, float]], total: int) -> str:
    """Server RSS after each quarter of the requests: a leak climbs steadily, allocator growth levels off."""
    marks = []
    for q in (0.25, 0.5, 0.75, 1.0):
        seen = [mb for done, mb in trace if done <= q * total]
        if seen:
            marks.append(f"{int(q * 100)}%: {seen[-1]:.1f}")
    return ", ".join(marks)


# ---------------------------------------------------------------- main


def probe(base: str) -> str:
    r = httpx.post(base + "/v1/chat/completions", json=PROBE, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def warm_up(base: str, long_prompt_chars: int) -> None:
    """One request of each kind, so that later growth is not first-use allocation."""
    rng = random.Random(0)
    kinds = ("chat", "chat_stream", "completion", "completion_stream", "infill", "extras", "extras", "extras",
             "slow_stream", "long_prompt", "huge")
    plan = [(k, request_body(k, rng, long_prompt_chars)) for k in kinds]
    asyncio.run(drive(base, plan, 1, time.monotonic() + 120, 0))


def print_report(report: Report, wall_s: float, rss: dict, checks: dict) -> None:
    lat, direct = report.latencies(), report.latencies(direct_only=True)
    lines = [
        f"requests: {len(report.results)} done, {report.skipped} skipped (time limit), {wall_s:.1f} s wall",
        "outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(report.outcomes().items())),
        f"429 answers (retried): {sum(r.busy_answers for r in report.results)}",
        "by kind:  " + ", ".join(f"{k}={v}" for k, v in sorted(Counter(r.kind for r in report.results).items())),
        (f"latency of ok requests: p50 {percentile(lat, 0.5) * 1e3:.0f} ms, "
         f"p99 {percentile(lat, 0.99) * 1e3:.0f} ms, "
         f"mean {statistics.fmean(lat) * 1e3 if lat else float('nan'):.0f} ms "
         "(including waits after 429s)"),
        (f"latency of ok requests never answered 429: p50 {percentile(direct, 0.5) * 1e3:.0f} ms, "
         f"p99 {percentile(direct, 0.99) * 1e3:.0f} ms ({len(direct)} requests)"),
        (f"server RSS: start {rss['start']:.1f} MB, after warm-up {rss['warm']:.1f} MB, after load {rss['end']:.1f} MB "
         f"(growth {rss['end'] - rss['warm']:+.1f} MB, bound +{rss['bound']:.0f} MB)"),
        (f"/health during the load: {len(report.health_s)} answers, {report.health_failures} failures, "
         f"p50 {percentile(report.health_s, 0.5) * 1e3:.1f} ms, p99 {percentile(report.health_s, 0.99) * 1e3:.1f} ms, "
         f"max {report.health_s[-1] * 1e3 if report.health_s else float('nan'):.1f} ms"),
        f"server RSS during the load (MB after % of requests): {rss_curve(report.rss_trace, len(report.results))}",
    ] + [f"check {name}: {'ok' if good else 'FAILED'}" for name, good in checks.items()]
    for r in report.unexpected()[:10]:
        lines.append(f"unexpected: {r.kind} -> {r.outcome} {r.detail}")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: a tiny random checkpoint made in a temp dir)")
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--time-limit", type=float, default=600, help="seconds for the traffic; the rest is skipped")
    ap.add_argument("--max-rss-growth-mb", type=float, default=200)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--server-max-queue", type=int, default=4)
    ap.add_argument("--prefix-cache-mb", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-prompt-chars", type=int, default=None,
                    help="characters of the long-prompt requests (default: --max-context - 64, which always fits)")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else make_tiny(Path(tmp))
        return run(model, args)


def make_tiny(tmp: Path) -> Path:
    out = tmp / "tiny"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_checkpoint.py"), str(out)], check=True,
                   capture_output=True)
    return out


def run(model: Path, args) -> int:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(model, port, args)
    try:
        wait_healthy(proc, base, 120)
        rss = {"start": rss_mb(proc.pid), "bound": args.max_rss_growth_mb}
        long_chars = args.long_prompt_chars or args.max_context - 64  # ASCII: at most one token per character
        warm_up(base, long_chars)
        before = probe(base)
        rss["warm"] = rss_mb(proc.pid)
        t0 = time.monotonic()
        plan = plan_requests(args.requests, random.Random(args.seed), long_chars)
        report = drive_with_health_probe(base, plan, args.clients, t0 + args.time_limit, args.seed, proc.pid)
        wall = time.monotonic() - t0
        checks = after_checks(proc, base, before)
        rss["end"] = rss_mb(proc.pid) if proc.poll() is None else float("nan")
        checks["memory growth within bound"] = rss["end"] - rss["warm"] <= args.max_rss_growth_mb
        checks["no unexpected outcomes"] = not report.unexpected()
        checks["/health always answered"] = report.health_failures == 0 and bool(report.health_s)
        print_report(report, wall, rss, checks)
        if args.json:
            write_json(args.json, report, wall, rss, checks)
        return 0 if all(checks.values()) else 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def after_checks(proc: subprocess.Popen, base: str, before: str) -> dict[str, bool]:
    checks = {"server alive": proc.poll() is None}
    try:
        checks["health 200"] = httpx.get(base + "/health", timeout=10).status_code == 200
        checks["same greedy answer as before"] = probe(base) == before
    except httpx.HTTPError:
        checks["server answers"] = False
    return checks


def write_json(path: str, report: Report, wall: float, rss: dict, checks: dict) -> None:
    lat = report.latencies()
    data = {"requests": len(report.results), "skipped": report.skipped, "wall_s": wall,
            "outcomes": dict(report.outcomes()), "busy_429_answers": sum(r.busy_answers for r in report.results),
            "p50_ms": percentile(lat, 0.5) * 1e3,
            "p99_ms": percentile(lat, 0.99) * 1e3,
            "direct_p50_ms": percentile(report.latencies(True), 0.5) * 1e3,
            "direct_p99_ms": percentile(report.latencies(True), 0.99) * 1e3, "rss_mb": rss,
            "health_p50_ms": percentile(report.health_s, 0.5) * 1e3,
            "health_p99_ms": percentile(report.health_s, 0.99) * 1e3,
            "health_max_ms": report.health_s[-1] * 1e3 if report.health_s else None,
            "health_failures": report.health_failures,
            "rss_trace": report.rss_trace, "checks": checks}
    Path(path).write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    sys.exit(main())
