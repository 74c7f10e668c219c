"""Spruce against the engines its users would pick instead: one machine, one checkpoint, one client.

    python scripts/bench_peers.py --out bench-out                       # bundled model, every engine
    python scripts/bench_peers.py --model DIR --out DIR --engines spruce-none,spruce-ngram,mlx-lm \\
        --classes code --max-tokens 128 [--draft-model DIR] [--llama-server PATH]

Starts each engine in turn on a free loopback port (Spruce with each speculation method,
`python -m mlx_lm server`, llama.cpp's `llama-server`), waits until it answers, runs the
`spruce bench` client against it (greedy, thinking off, streamed, one warm-up run per prompt
discarded), and stops it before the next, so that only one model is in memory at a time. Prefix /
prompt caches are off in every engine, so each measured run pays its prefill. An engine that is
not available here (not installed, no draft model, no llama-server) is listed as not run, with
why. Writes OUT/engines/<engine>.json, OUT/results.md (the table and a check of the goal),
OUT/decode_tps.png and OUT/itl.png, and each server's log in OUT/logs/.

The first engine that runs is the reference for "same text" and the baseline for ratios
(spruce-none by default: plain decoding, whose text every speculation method must reproduce).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peer_engines import ENGINES, PeerOptions, Unavailable, model_context, prepare  # noqa: E402

from server.bench.command import slug, write_outputs  # noqa: E402
from server.bench.prompts import class_names, class_target_tokens  # noqa: E402
from server.bench.records import ClassSummary, EngineResult, save  # noqa: E402
from server.bench.runner import CONTEXT_MARGIN, BenchConfig, describe_machine, run_bench  # noqa: E402

GOAL_CLASS = "code"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so the running server is stopped too
    model = Path(a.model).resolve()
    if not (model / "config.json").is_file():
        sys.exit(f"bench_peers: {a.model} is not a checkpoint directory (no config.json)")
    engines = [e for item in a.engines for e in item.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        sys.exit(f"bench_peers: unknown engine {', '.join(unknown)} (known: {', '.join(ENGINES)})")
    classes = [c for item in a.classes for c in item.split(",") if c]
    out = Path(a.out)
    (out / "engines").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model_ctx = model_context(model)
    # Servers get room for the largest selected prompt; the client skips what the model cannot hold.
    needed = max(class_target_tokens(c) for c in classes) + a.max_tokens + CONTEXT_MARGIN
    server_ctx = max(2048, min(needed, model_ctx) if model_ctx else needed)
    opts = PeerOptions(model=model, draft_model=Path(a.draft_model).resolve() if a.draft_model else None,
                       work=Path(a.work or out / "work").resolve(), context=server_ctx,
                       mlx_lm_dtype=a.mlx_lm_dtype, mlx_lm_draft_tokens=a.mlx_lm_draft_tokens,
                       llama_server=a.llama_server, llama_convert=a.llama_convert,
                       gguf=Path(a.gguf).resolve() if a.gguf else None, gguf_type=a.gguf_type,
                       threads=a.threads)
    results: list[EngineResult] = []
    reference: EngineResult | None = None
    for name in engines:
        config = BenchConfig(base_url="http://127.0.0.1:0", classes=tuple(classes), max_tokens=a.max_tokens,
                             runs=a.runs, warmup=a.warmup, prompts_per_class=a.prompts_per_class,
                             tokenizer=str(model) if (model / "tokenizer.json").is_file() else None,
                             max_context=model_ctx, label=name, timeout_s=a.timeout)
        result = run_engine(name, opts, config, reference, out, a.ready_timeout)
        save(result, out / "engines" / f"{slug(name)}.json")
        results.append(result)
        if reference is None and not result.skipped:
            reference = result
    title = f"bench_peers: {model.name}"
    write_outputs(results, out, plots=not a.no_plots, title=title)
    with open(out / "results.md", "a", encoding="utf-8") as f:
        f.write("\n" + goal_check(results) + "\n")
    print((out / "results.md").read_text(encoding="utf-8"))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "engine" / "bundled" / "target"), help="checkpoint directory")
    ap.add_argument("--draft-model", default=None, help="draft checkpoint (default: the bundled draft, for the "
                                                         "bundled target only)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), help=f"any of: {', '.join(ENGINES)}")
    ap.add_argument("--classes", nargs="+", default=class_names(), help=f"any of: {', '.join(class_names())}")
    ap.add_argument("--prompts-per-class", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=1, help="measured runs per prompt")
    ap.add_argument("--warmup", type=int, default=1, help="discarded runs per prompt before those")
    ap.add_argument("--mlx-lm-dtype", choices=["float32", "as-is"], default="float32",
                    help="float32: give mlx-lm a float32 copy (Spruce computes in float32); as-is: the file")
    ap.add_argument("--mlx-lm-draft-tokens", type=int, default=3)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: on PATH)")
    ap.add_argument("--llama-convert", default=None, help="llama.cpp's convert_hf_to_gguf.py (default: found "
                                                          "above the llama-server binary)")
    ap.add_argument("--gguf", default=None, help="a GGUF of the checkpoint (default: convert one)")
    ap.add_argument("--gguf-type", default="f32", help="converter --outtype (f32, bf16, q8_0; default f32)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads per engine: OPENBLAS_NUM_THREADS for Spruce and mlx-lm, -t for llama-server "
                         "(default: each engine's own; on a loaded machine llama.cpp's spin-waiting threads suffer)")
    ap.add_argument("--work", default=None, help="where converted checkpoints go (default OUT/work)")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to start")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--no-plots", action="store_true")
    return ap.parse_args(argv)


def run_engine(name: str, opts: PeerOptions, config: BenchConfig, reference: EngineResult | None, out: Path,
               ready_timeout: float) -> EngineResult:
    port = free_port()
    try:
        launch = prepare(name, opts, port)
    except Unavailable as e:
        print(f"bench_peers: {name}: not run: {e}", file=sys.stderr)
        return skipped_result(name, config, str(e))
    if opts.threads is not None:
        launch.info["threads"] = opts.threads
    print(f"bench_peers: starting {name}: {launch.info.get('command')}", file=sys.stderr)
    log_path = out / "logs" / f"{slug(name)}.log"
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(launch.argv, env=launch.env, cwd=launch.cwd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            base_url = f"http://127.0.0.1:{port}"
            why = wait_ready(proc, base_url, ready_timeout)
            if why is not None:
                return skipped_result(name, config, f"{why} (log: {log_path.name}: {last_line(log_path)})")
            bench = replace(config, base_url=base_url, extra_body=launch.extra_body)
            result = run_bench(bench, reference, engine_info=launch.info)
            if any(p.error for p in result.prompts):
                result.engine_info["server error"] = last_error(log_path)
            return result
        finally:
            stop(proc)


def skipped_result(name: str, config: BenchConfig, why: str) -> EngineResult:
    return EngineResult(label=name, base_url="", model=None, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        machine=describe_machine(), settings={"max_tokens": config.max_tokens}, skipped=why)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, base_url: str, timeout: float) -> str | None:
    """None once the server answers GET /health with 200; else why not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with status {proc.returncode} before answering"
        try:  # /health: Spruce, mlx_lm.server and llama-server (503 while it loads) all have it
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return f"the server did not answer within {timeout:.0f} s"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it was started in its own session), then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def last_error(path: Path) -> str:
    """The last line of a server log that names an error (Python's "ValueError: ...", llama.cpp's "error")."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    hits = [ln.strip() for ln in lines if "Error" in ln or "error" in ln]
    return hits[-1][:300] if hits else "none in the log"


def last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "empty"


def goal_check(results: list[EngineResult], cls: str = GOAL_CLASS) -> str:
    """The issue's goal, on `cls` prompts: Spruce's best configuration has the highest decode tok/s
    of the engines at identical greedy output, and its p99 inter-token latency is no worse than
    plain decoding's."""
    rows: dict[str, ClassSummary] = {}
    for r in results:
        row = r.summary(cls)
        if not r.skipped and row is not None and row.runs:
            rows[r.label] = row
    speed = {name: row.decode_tps for name, row in rows.items() if row.decode_tps}
    spruce = {name: tps for name, tps in speed.items() if name.startswith("spruce-")}
    lines = [f"## Goal check ({cls} prompts)", ""]
    if not spruce:
        return "\n".join(lines + ["No Spruce configuration ran on this class."])
    best_name = max(spruce, key=lambda name: spruce[name])
    best, best_tps = rows[best_name], spruce[best_name]
    lines.append(f"- Spruce's best configuration: {best_name}, {best_tps:.1f} tok/s "
                 f"(same text as the reference: {best.same_as_reference or '-'}).")
    for name, tps in speed.items():
        if name != best_name:
            lines.append(f"- vs {name}: {tps:.1f} tok/s, ratio {best_tps / tps:.2f}x "
                         f"(same text: {rows[name].same_as_reference or '-'})")
    others = [tps for name, tps in speed.items() if not name.startswith("spruce-")]
    verdict = ("no other engine ran" if not others else "yes" if best_tps >= max(others) else "no")
    lines.append(f"- Highest decode tok/s of the engines: {verdict}.")
    plain = rows.get("spruce-none")
    if plain is not None and plain.itl_p99_ms and best.itl_p99_ms:
        no_worse = "yes" if best.itl_p99_ms <= plain.itl_p99_ms else "no"
        lines.append(f"- p99 inter-token latency {best.itl_p99_ms:.1f} ms vs plain decoding's "
                     f"{plain.itl_p99_ms:.1f} ms: no worse: {no_worse}.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
