"""MLX's CPU float32 products with and without the engine's GEMV shim (engine/gemv_shim.c),
each setting in its own process (a preload is fixed at process start), the two alternated.

    python scripts/bench_gemv_shim.py [--rounds 2] [--rows 1,2,4,7,17] [--reps 100]
        [--shapes 8192x384,1176x384,768x384,384x768]

Each product is `x @ W.T` (W [out x in], x [1, M, in]: what nn.Linear runs), `--launches`
independent products an evaluation, median µs a product over --reps evaluations. Default shapes:
the bundled model's output projection, its GDN input projections (stacked), its MLP gate / up and
down. Prints one table: per shape and row count, without / with the shim per round, and the ratio
of the medians. Linux with OpenBLAS (the script re-execs itself with it preloaded).
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


def measure(shapes: list[tuple[int, int]], rows: list[int], reps: int, launches: int) -> dict[str, float]:
    """In this process: µs a product, per 'OxI/M' (graph building and evaluation: bench_op_costs.timed)."""
    import mlx.core as mx
    from bench_op_costs import timed

    out = {}
    for o, i in shapes:
        w = mx.random.normal((o, i))
        for m in rows:
            xs = [mx.random.normal((1, m, i)) for _ in range(launches)]
            mx.eval(w, xs)
            build, _, evaluation = timed(lambda w=w, xs=xs: [x @ w.T for x in xs], reps)
            out[f"{o}x{i}/{m}"] = (build + evaluation) * 1e3 / launches
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two settings")
    ap.add_argument("--rows", default="1,2,4,7,17")
    ap.add_argument("--shapes", default="8192x384,1176x384,768x384,384x768")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--launches", type=int, default=8, help="independent products an evaluation")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    if os.environ.get("SPRUCE_BENCH_CHILD"):
        from engine import blas

        result = measure(shapes, rows, args.reps, args.launches)  # type: ignore[arg-type]
        print(json.dumps({"shim": blas.gemv_calls() is not None, "us": result}))
        return
    seen: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for shim in (False, True):
            env = dict(os.environ, SPRUCE_BENCH_CHILD="1")
            env.pop("LD_PRELOAD", None)
            env.pop("SPRUCE_NO_BLAS_PRELOAD", None)
            if not shim:
                env["SPRUCE_NO_GEMV_SHIM"] = "1"
            else:
                env.pop("SPRUCE_NO_GEMV_SHIM", None)
            p = subprocess.run([sys.executable, *sys.orig_argv[1:]], env=env, capture_output=True, text=True,
                               check=True)
            report = json.loads(p.stdout.strip().splitlines()[-1])
            if report["shim"] != shim:
                sys.exit(f"the child {'lacks' if shim else 'has'} the shim: no C compiler, or no OpenBLAS?")
            seen[shim].append(report["us"])
    print(f"x @ W.T, fp32, µs a product (median of {args.reps} evaluations of {args.launches}); "
          f"without / with the shim, {args.rounds} rounds alternated")
    print("| weight | rows | without | with | with / without |\n|---|---|---|---|---|")
    for key in seen[False][0]:
        w, m = key.split("/")
        off = [r[key] for r in seen[False]]
        on = [r[key] for r in seen[True]]
        print(f"| {w} | {m} | {', '.join(f'{v:.1f}' for v in off)} | {', '.join(f'{v:.1f}' for v in on)} | "
              f"{statistics.median(on) / statistics.median(off):.2f} |", flush=True)


if __name__ == "__main__":
    main()
