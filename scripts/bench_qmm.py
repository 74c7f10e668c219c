"""Micro-benchmark of the small-M quantized matmul: mx.quantized_matmul, the batch-invariant
kernel (metal/qmm_rows.kernel) and the read floor (a kernel that only streams the packed weights),
side by side, for the layer shapes of the 9B, 0.8B and bundled Qwen3.5 layouts.

    python scripts/bench_qmm.py [--rows 1,2,4,8,16,32] [--launches 40]

On a GPU machine. Each figure is the median of 5 evaluations of `--launches` independent launches,
divided by the launches: µs per launch, and TB/s of packed weights + scales + biases read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels import gpu_backend, quantized_matmul_rows, read_floor  # noqa: E402

SHAPES = {  # [out x in] of the matmuls a decode step runs
    "9b mlp up/gate": (12288, 4096), "9b mlp down": (4096, 12288), "9b gdn in_proj_qkv": (8192, 4096),
    "9b lm_head": (248320, 4096), "0.8b mlp up": (3584, 1024), "bundled mlp up": (768, 384),
}


def per_launch_us(fn, launches: int) -> float:
    mx.eval(fn())

    def once() -> float:
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(launches)])
        return (time.perf_counter() - t0) / launches * 1e6

    return statistics.median(once() for _ in range(5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--launches", type=int, default=40)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    a = ap.parse_args()
    backend = gpu_backend()
    if backend is None:
        sys.exit("bench_qmm needs a GPU backend")
    rows = [int(r) for r in a.rows.split(",")]
    print(f"{mx.default_device()}, {a.bits}-bit g{a.group_size}, bf16 activations; us per launch "
          f"(built-in / kernel), read floor and its TB/s")
    print("| weight | read floor | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for name, (out, inp) in SHAPES.items():
        print(row(name, out, inp, rows, a, backend), flush=True)


def row(name: str, out: int, inp: int, rows: list[int], a: argparse.Namespace, backend: str) -> str:
    w = mx.random.normal((out, inp)).astype(mx.bfloat16) * 0.02
    wq, scales, biases = mx.quantize(w, group_size=a.group_size, bits=a.bits)
    mx.eval(wq, scales, biases)
    nbytes = wq.nbytes + scales.nbytes + biases.nbytes
    floor = per_launch_us(partial(read_floor, wq, scales, biases, a.group_size, a.bits, backend), a.launches)
    cells = []
    for m in rows:
        x = mx.random.normal((m, inp)).astype(mx.bfloat16)
        builtin = per_launch_us(partial(mx.quantized_matmul, x, wq, scales, biases, transpose=True,
                                        group_size=a.group_size, bits=a.bits), a.launches)
        ours = per_launch_us(partial(quantized_matmul_rows, x, wq, scales, biases, a.group_size, a.bits, backend),
                             a.launches)
        cells.append(f"{builtin:.1f} / **{ours:.1f}**")
    return (f"| {name} {out}x{inp} | {floor:.1f} us ({nbytes / floor / 1e6:.2f} TB/s) | " + " | ".join(cells)
            + " |")

if __name__ == "__main__":
    main()
