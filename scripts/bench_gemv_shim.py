"""MLX's CPU float32 products through the engine's BLAS shim (engine/gemv_shim.c): its small-row
path against OpenBLAS, each setting in its own process, the processes alternated.

    python scripts/bench_gemv_shim.py [--rows 2,4,8,17,33,48] [--reps 15] [--rounds 2]
        [--shapes 8192x384,1176x384,768x384,384x768] [--settings off,small,small-1thread,half] [--warm]

Each product is `x @ W.T` (W [out x in], x [1, M, in]: what nn.Linear runs). Default shapes: the
bundled model's output projection, its GDN input projections (stacked), its MLP gate / up and
down. Settings (engine.blas.SMALL_ROWS and GEMM_THREADS, written into the loaded shim):
- off: the small-row path off: products of up to 4 rows as one OpenBLAS GEMV a row, larger ones
  through OpenBLAS's GEMM (the shim as it was before the path existed);
- small: products of up to --rows' largest through the small-row path, on every core;
- small-1thread: the same on the calling thread alone;
- half, half-1thread: the weights' values rounded to bfloat16 and registered with the shim
  (engine/half_weights.py), so that every product by them, one row included, reads their bfloat16
  copies (on every core, or on the calling thread alone).
In the other settings one-row products take the small-row path too (engine/gemv_shim.c).
A decode step reads a model's weights from memory, not from cache, so by default an evaluation
multiplies by distinct weights that add up to 64 MB or more (--warm: one weight, over and over).
One process a setting: OpenBLAS's threads spin for a while after each of its products, and on a
machine of two cores that takes the core from the shim's helper thread, which a verify (whose
products of 2-33 rows never call OpenBLAS) sees less of. Median µs a product over --reps
evaluations (after three warm-ups); per setting the median of the rounds, and off / small.
Linux with OpenBLAS and a C compiler (the script re-execs itself with both preloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402
from bench_op_costs import timed  # noqa: E402

from engine import blas, half_weights  # noqa: E402

# name -> (rows, threads, from bfloat16 copies)
SETTINGS = {"off": (0, 0, False), "small": (None, 0, False), "small-1thread": (None, 1, False),
            "half": (None, 0, True), "half-1thread": (None, 1, True)}
COLD_BYTES = 64 << 20


def measure(shapes: list[tuple[int, int]], rows: list[int], reps: int, warm: bool, half: bool) -> dict[str, float]:
    """In this process, at its settings: median µs a product, per 'OxI/M' (graph building and
    evaluation: bench_op_costs.timed)."""
    out = {}
    for o, i in shapes:
        count = 1 if warm else -(-COLD_BYTES // (o * i * 4))
        weights = [mx.random.normal((o, i)) for _ in range(count)]
        if half:
            weights = [w.astype(mx.bfloat16).astype(mx.float32) for w in weights]
        mx.eval(weights)
        if half and half_weights.register(measure, weights) != len(weights):  # for the process's life
            sys.exit("the shim did not take the weights' bfloat16 copies")
        for m in rows:
            x = mx.random.normal((1, m, i))
            mx.eval(x)
            build, _, evaluation = timed(lambda x=x, ws=weights: [x @ w.T for w in ws], reps)
            out[f"{o}x{i}/{m}"] = (build + evaluation) * 1e3 / count
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,4,8,17,33,48")
    ap.add_argument("--shapes", default="8192x384,1176x384,768x384,384x768")
    ap.add_argument("--settings", default="off,small,small-1thread")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the settings' processes")
    ap.add_argument("--warm", action="store_true", help="one weight, read from cache")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the setting this process measures
    args = ap.parse_args()
    if blas.SMALL_ROWS.value is None:
        sys.exit("the shim is not loaded here: Linux with OpenBLAS and a C compiler needed")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        limit, threads, half = SETTINGS[args.child]
        blas.SMALL_ROWS.value = max(rows) if limit is None else limit
        blas.GEMM_THREADS.value = threads
        print(json.dumps(measure(shapes, rows, args.reps, args.warm, bool(half))))  # type: ignore[arg-type]
        return
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        sys.exit(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    seen: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for name in settings:
            p = subprocess.run([sys.executable, *sys.orig_argv[1:], "--child", name], capture_output=True, text=True,
                               check=True, env=dict(os.environ))
            seen[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(f"x @ W.T, fp32, µs a product (median of {args.reps}; of {args.rounds} processes a setting, alternated); "
          f"weights {'from cache' if args.warm else 'distinct, 64 MB an evaluation'}")
    print("| weight | rows | " + " | ".join(settings) + " | off / small | small / half |\n|---|---|"
          + "---|" * (len(settings) + 2))
    for key in seen[settings[0]][0]:
        w, m = key.split("/")
        med = {s: statistics.median(r[key] for r in seen[s]) for s in settings}
        ratios = [f"{med[a] / med[b]:.2f}" if {a, b} <= med.keys() else "-" for a, b in (("off", "small"),
                                                                                          ("small", "half"))]
        print(f"| {w} | {m} | " + " | ".join(f"{med[s]:.1f}" for s in settings) + f" | {' | '.join(ratios)} |",
              flush=True)


if __name__ == "__main__":
    main()
