"""What a quantized projection costs on MLX's CPU backend against the same weights in float32: why
the loader turns quantized checkpoints float32 on the CPU where memory allows
(engine/models/qlinear.py dequantize_projections).

    python scripts/bench_cpu_dequant.py [--shapes 8192x384,1176x384,2048x2048,6144x1024] [--rows 1,4]
        [--bits 4,8] [--reps 30]

Per shape, bit width and row count, median µs of: `mx.quantized_matmul` (what a quantized model
runs below CPU_DEQUANT_ROWS rows), the engine's dequantize + matmul (from that many rows on), the
dequantize alone, and the float32 product `x @ W.T` of the dequantized weight (what a model
loaded float32 runs; through the GEMV shim where it is loaded, engine/gemv_shim.c). Also ns a
weight for the quantized matmul at one row and for the float32 product.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402
from bench_op_costs import timed as op_costs_timed  # noqa: E402

from engine import blas  # noqa: E402
from engine.qmm import dequantized_matmul  # noqa: E402


def timed(fn, reps: int) -> float:
    """Median µs a call takes, graph building and evaluation together (bench_op_costs.timed)."""
    build, _, evaluation = op_costs_timed(fn, reps)
    return (build + evaluation) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8192x384,1176x384,2048x2048,6144x1024")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    gs = args.group_size
    print(f"{mx.default_device()}, GEMV shim {'loaded' if blas.gemv_calls() is not None else 'not loaded'}; "
          f"µs, medians of {args.reps}")
    print("| weight | bits | rows | quantized matmul | dequantize + matmul | dequantize alone | float32 product "
          "| quantized / float32 |\n|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        o, i = (int(v) for v in shape.split("x"))
        w = mx.random.normal((o, i)) * 0.05
        mx.eval(w)
        for bits in (int(b) for b in args.bits.split(",")):
            wq, scales, biases = mx.quantize(w, group_size=gs, bits=bits)
            dense = mx.dequantize(wq, scales, biases, group_size=gs, bits=bits)
            mx.eval(wq, scales, biases, dense)
            for m in (int(r) for r in args.rows.split(",")):
                x = mx.random.normal((1, m, i))
                mx.eval(x)
                q = timed(lambda x=x, wq=wq, s=scales, b=biases, bits=bits: mx.quantized_matmul(
                    x, wq, s, b, transpose=True, group_size=gs, bits=bits), args.reps)
                dq = timed(lambda x=x, wq=wq, s=scales, b=biases, bits=bits: dequantized_matmul(
                    x, wq, s, b, gs, bits), args.reps)
                alone = timed(lambda wq=wq, s=scales, b=biases, bits=bits: mx.dequantize(
                    wq, s, b, group_size=gs, bits=bits), args.reps)
                f = timed(lambda x=x, dense=dense: x @ dense.T, args.reps)
                print(f"| {o} x {i} | {bits} | {m} | {q:.0f} ({1e3 * q / (o * i):.2f} ns a weight) | {dq:.0f} | "
                      f"{alone:.0f} | {f:.0f} ({1e3 * f / (o * i):.3f} ns a weight) | {q / f:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
