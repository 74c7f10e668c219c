"""Decoding speed under MLX's CUDA graph settings, each in a fresh process.

    python scripts/bench_cuda_graphs.py [--model DIR] [--dflash-model DIR] [--dtype bfloat16]
        [--settings "default;MLX_MAX_OPS_PER_BUFFER=50;MLX_USE_CUDA_GRAPHS=0"] [--methods none,mtp:chain]
        [--tokens 128] [--runs 3] [--rounds 2] [--json OUT.json]

Why: on the H200 a decode step waits for the host encoding its ~380-450 operations (BENCHMARKS.md,
issue 12, twenty-fourth session). MLX's CUDA backend records them into CUDA graphs of at most
MLX_MAX_OPS_PER_BUFFER nodes (mlx 0.32 picks by compute capability: 100 on an H100 / H200, 20 on
most others; also MLX_MAX_MB_PER_BUFFER, 1000 there), commits each as it fills, and keeps
MLX_CUDA_GRAPH_CACHE_SIZE instantiated graphs (400) to update by topology; MLX_USE_CUDA_GRAPHS=0
launches kernels directly (mlx/backend/cuda/device.cpp). These are read once a process, so each
setting runs in its own process (the engine loaded, every method warmed up once, then `--runs`
greedy generations of `--tokens` tokens of scripts/bench_spec.py's first code prompt per method);
`--rounds` repeats the sweep with the settings interleaved, so a drifting machine hits them alike.
Prints, per setting and method, the median decode tok/s over all its runs, its ratio to the first
setting's, tokens per forward and whether the output equals the first setting's (graph settings must
not change it). A process took ~35 s on the H200 with the bundled pair (loading, warming both
methods up, 2 runs of each), ~25-30 s with the 9B-shaped 4-bit pair once its files were cached. On
the H200 the processes themselves differ by up to 1.5x (BENCHMARKS.md, issue 12, twenty-sixth
session), so compare settings over several rounds, never one process each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

BUNDLED = Path(__file__).resolve().parents[1] / "engine" / "bundled" / "target"


def parse_settings(text: str) -> list[tuple[str, dict[str, str]]]:
    """"default;A=1,B=2" -> [("default", {}), ("A=1,B=2", {"A": "1", "B": "2"})]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        env = {} if item == "default" else dict(kv.split("=", 1) for kv in item.split(","))
        out.append((item, env))
    return out


def timed_generations(model: str, dtype: str, dflash_model: str | None, methods: str, tokens: int,
                      runs: int, ignore_eos: bool = False) -> dict[str, dict]:
    """Every method warmed up, then `runs` greedy generations of bench_spec.py's first code prompt
    -> {method: {"tps": decode tok/s of each run, "tokens": the last run's, "tok_fwd"}, "_device"}."""
    import mlx.core as mx
    from bench_spec import PROMPTS, parse_methods, render

    from engine.config import EngineConfig, SamplingParams, SpecConfig
    from engine.generate import Engine
    from engine.types import GenerationRequest

    engine = Engine(EngineConfig(model_path=model, dtype=dtype, spec=SpecConfig(dflash_model=dflash_model)))
    specs = parse_methods(methods, [16], 0, argparse.Namespace(draft_model=None, dflash_model=dflash_model,
                                                               adaptive=False))
    prompt = render(engine, PROMPTS["code"][0])
    result: dict[str, dict] = {}
    for name, spec in specs.items():
        sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=ignore_eos)
        req = GenerationRequest(prompt_ids=prompt, sampling=sampling, spec=spec)
        list(engine.generate(req))  # compiles this method's shapes
        tps, per_forward = [], 0.0
        out: list[int] = []
        for _ in range(runs):
            out = []
            for step in engine.generate(req):
                out += step.token_ids
                if step.stats is not None:
                    tps.append(step.stats.decode_tps)
                    per_forward = step.stats.tokens_per_forward
        result[name] = {"tps": tps, "tokens": out, "tok_fwd": per_forward}
    result["_device"] = {"device": str(mx.default_device()), "mlx": mx.__version__}
    return result


def worker(a: argparse.Namespace) -> None:
    """One process: timed_generations, one JSON line on stdout."""
    print(json.dumps(timed_generations(a.model, a.dtype, a.dflash_model, a.methods, a.tokens, a.runs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--dflash-model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--settings", default="default;MLX_MAX_OPS_PER_BUFFER=50;MLX_MAX_OPS_PER_BUFFER=200;"
                                          "MLX_CUDA_GRAPH_CACHE_SIZE=1000;MLX_USE_CUDA_GRAPHS=0")
    ap.add_argument("--methods", default="none,mtp:chain")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one process may take")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    settings = parse_settings(a.settings)
    argv = [sys.executable, __file__, "--worker", "--model", a.model, "--dtype", a.dtype, "--methods", a.methods,
            "--tokens", str(a.tokens), "--runs", str(a.runs)] + (["--dflash-model", a.dflash_model]
                                                                  if a.dflash_model else [])
    runs: dict[str, list[dict]] = {name: [] for name, _ in settings}
    errors: dict[str, str] = {}
    for r in range(a.rounds):
        for name, env in settings:
            t0 = time.perf_counter()
            try:
                p = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True,
                                   timeout=a.timeout)
            except subprocess.TimeoutExpired:
                errors[name] = f"round {r}: over {a.timeout:.0f} s"
                continue
            seconds = time.perf_counter() - t0
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                errors[name] = f"round {r}: rc {p.returncode}: {p.stderr.strip()[-400:]}"
                continue
            runs[name].append(json.loads(lines[-1]))
            print(f"round {r} {name} ({seconds:.0f} s): " + ", ".join(
                f"{m} {statistics.median(v['tps']):.1f} tok/s" for m, v in runs[name][-1].items() if m != "_device"),
                flush=True)
    report = summarise(runs)
    report["errors"] = errors
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Median tok/s over every run of a setting, against the first setting's; the output compared."""
    first = next(iter(runs))
    table: dict[str, dict[str, dict]] = {}
    base: dict[str, float] = {}
    for name, procs in runs.items():
        table[name] = {}
        for method in (m for m in (procs[0] if procs else {}) if m != "_device"):
            tps = [t for p in procs for t in p[method]["tps"]]
            med = statistics.median(tps)
            base.setdefault(method, med if name == first else float("nan"))
            ref = runs[first][0][method]["tokens"] if runs[first] else None
            table[name][method] = {"tok_s": med, "vs_first": med / base[method], "runs": len(tps),
                                   "tok_fwd": procs[0][method]["tok_fwd"],
                                   "same": all(p[method]["tokens"] == ref for p in procs)}
    print(f"\n{'setting':42} {'method':12} {'tok/s':>7} {'vs first':>8} {'tok/fwd':>7} {'runs':>4} same")
    for name, rows in table.items():
        for method, row in rows.items():
            print(f"{name:42} {method:12} {row['tok_s']:7.1f} {row['vs_first']:7.2f}x {row['tok_fwd']:7.2f} "
                  f"{row['runs']:4d} {'yes' if row['same'] else 'NO'}")
    return {"table": table, "raw": runs}


if __name__ == "__main__":
    main()
