"""Micro-benchmark of the small-M quantized matmul: mx.quantized_matmul (built-in), the scalar
batch-invariant kernel (metal/qmm_rows.kernel), the tensor-core one (metal/qmm_mma.kernel, CUDA)
and the read floor (a kernel that only streams the packed weights: on CUDA at the memory's
streaming rate, metal/read_stream.kernel; on Metal in qmm_rows' launch shape), side by side, for the layer
shapes of the 9B, 4B, 0.8B and bundled Qwen3.5 layouts (fused projections included).

    python scripts/bench_qmm.py [--rows 1,2,4,8,16,17,32] [--mode throughput|latency] [--launches 40]
                                [--configs 1x8,2x8] [--paired 1,0] [--dequant]
                                [--shapes "9b mlp down,..."]

    e.g. prefill-sized rows: --rows 512,2048 --dequant --no-rows-kernel (qmm_mma covers <= 32 rows)

On a GPU machine. throughput: the median of 5 evaluations of `--launches` independent launches,
divided by the launches (MLX CUDA overlaps independent launches, so this is what a kernel costs
when others run beside it). latency: one launch per evaluation, median of 30, minus the median
of the same evaluation of a one-element op (the host's synchronisation), which is what a launch
costs on the critical path of a forward pass. µs per launch; TB/s of packed weights + scales +
biases read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx

from engine.kernels import gpu_backend  # noqa: E402
from engine.qmm import (  # noqa: E402
    mma_config,
    mma_covers,
    quantized_matmul_mma,
    quantized_matmul_rows,
    read_floor,
    read_stream,
)

SHAPES = {  # [out x in] of the matmuls a decode step runs; "fused" = the loader's stacked projections
    "9b gdn in_proj fused": (12352, 4096), "9b mlp gate|up fused": (24576, 4096), "9b mlp down": (4096, 12288),
    "9b gdn out_proj": (4096, 4096), "9b attn qkv fused": (10240, 4096), "9b attn o_proj": (4096, 4096),
    "9b lm_head": (248320, 4096), "4b mlp gate|up fused": (18432, 2560), "4b mlp down": (2560, 9216),
    "0.8b mlp gate|up fused": (7168, 1024), "0.8b mlp down": (1024, 3584), "bundled mlp gate|up fused": (1536, 384),
}


def dequant_matmul(x: mx.array, wq: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                   bits: int) -> mx.array:
    return x @ mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits).T


def throughput_us(fn: Callable[[], mx.array], launches: int) -> float:
    mx.eval(fn())

    def once() -> float:
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(launches)])
        return (time.perf_counter() - t0) / launches * 1e6

    return statistics.median(once() for _ in range(5))


def latency_us(fn: Callable[[], mx.array], _launches: int) -> float:
    mx.eval(fn())

    def once(f: Callable[[], mx.array]) -> float:
        t0 = time.perf_counter()
        mx.eval(f())
        return (time.perf_counter() - t0) * 1e6

    one = mx.ones((1,))
    sync = statistics.median(once(lambda: one + 1) for _ in range(30))
    return statistics.median(once(fn) for _ in range(30)) - sync


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,17,32")
    ap.add_argument("--mode", choices=["throughput", "latency"], default="throughput")
    ap.add_argument("--launches", type=int, default=40)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--configs", default="", help="qmm_mma (RT x KW) settings to sweep, e.g. 1x8,2x8,1x4")
    ap.add_argument("--paired", default="", help="qmm_mma's paired dequantization (DQ), each setting in turn: "
                                                 "e.g. 1,0 (default: the engine's, engine.qmm.MMA_PAIRED_DEQUANT)")
    ap.add_argument("--shapes", default="", help="comma-separated names of SHAPES (default: all)")
    ap.add_argument("--no-rows-kernel", action="store_true", help="leave out the scalar qmm_rows kernel")
    ap.add_argument("--dequant", action="store_true",
                    help="add dequantize-then-matmul (bf16 GEMM over weights dequantized per call): the "
                         "candidate for prefill-sized row counts, where MLX's quantized kernel is far from "
                         "the tensor cores' throughput")
    ap.add_argument("--dense", action="store_true",
                    help="add the bf16 matmul over the unquantized weight (x @ w.T), last in each cell: what a "
                         "bf16 checkpoint's projections cost at each row count")
    ap.add_argument("--builds", default="",
                    help="qmm_mma's fused builds instead of the kernels above, each cell their µs in this order "
                         "(engine.models.fused_qmm): e.g. plain,norm,res,swiglu-res")
    a = ap.parse_args()
    backend = gpu_backend()
    if backend is None:
        sys.exit("bench_qmm needs a GPU backend")
    rows = [int(r) for r in a.rows.split(",")]
    configs = [tuple(int(v) for v in c.split("x")) for c in a.configs.split(",") if c]
    a.paired_settings = [bool(int(v)) for v in a.paired.split(",") if v] or [None]
    names = [s.strip() for s in a.shapes.split(",") if s.strip()] or list(SHAPES)
    kernels = ("built-in" + ("" if a.no_rows_kernel else " / qmm_rows") + (" / dequant+matmul" if a.dequant else "")
               + (" / qmm_mma" if backend == "cuda" else "") + (" / bf16 dense" if a.dense else ""))
    if a.builds:
        kernels = f"qmm_mma builds {a.builds.replace(',', ' / ')}"
    print(f"{mx.default_device()}, {a.bits}-bit g{a.group_size}, bf16 activations, {a.mode}; us per launch "
          f"({kernels}); read floor and its TB/s")
    print("| weight | read floor | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for name in names:
        out, inp = SHAPES[name]
        print(row(name, out, inp, rows, a, backend, configs), flush=True)


def row(name: str, out: int, inp: int, rows: list[int], a: argparse.Namespace, backend: str,
        configs: list[tuple[int, ...]]) -> str:
    timed = latency_us if a.mode == "latency" else throughput_us
    w = mx.random.normal((out, inp)).astype(mx.bfloat16) * 0.02
    wq, scales, biases = mx.quantize(w, group_size=a.group_size, bits=a.bits)
    mx.eval(wq, scales, biases)
    nbytes = wq.nbytes + scales.nbytes + biases.nbytes
    floor_fn = (partial(read_stream, wq, scales, biases) if backend == "cuda"
                else partial(read_floor, wq, scales, biases, a.group_size, a.bits, backend))
    floor = timed(floor_fn, a.launches)
    cells = []
    for m in rows:
        if a.builds:
            cells.append(" / ".join(f"{t:.1f}" for t in build_times(m, out, inp, wq, scales, biases, a, timed)))
            continue
        x = mx.random.normal((m, inp)).astype(mx.bfloat16)
        times = [timed(partial(mx.quantized_matmul, x, wq, scales, biases, transpose=True, group_size=a.group_size,
                               bits=a.bits), a.launches)]
        if not a.no_rows_kernel:
            times.append(timed(partial(quantized_matmul_rows, x, wq, scales, biases, a.group_size, a.bits, backend),
                               a.launches))
        if a.dequant:
            times.append(timed(partial(dequant_matmul, x, wq, scales, biases, a.group_size, a.bits), a.launches))
        if backend == "cuda" and mma_covers(x, wq, scales, biases, a.group_size, a.bits):
            for config in configs or [mma_config(out, inp, a.bits)]:
                for paired in a.paired_settings:
                    times.append(timed(partial(quantized_matmul_mma, x, wq, scales, biases, a.group_size,
                                               a.bits, tuple(config), paired), a.launches))
        if a.dense:
            times.append(timed(partial(lambda x: x @ w.T, x), a.launches))
        cells.append(" / ".join(f"{t:.1f}" for t in times))
    label = f"{name} {out}x{inp}" + (f" (configs {', '.join('x'.join(map(str, c)) for c in configs)})"
                                     if configs else f" (mma {'x'.join(map(str, mma_config(out, inp, a.bits)))})")
    if a.paired:
        label += f" (paired dequantization {a.paired})"
    return f"| {label} | {floor:.1f} us ({nbytes / floor / 1e6:.2f} TB/s) | " + " | ".join(cells) + " |"


def build_times(m: int, out: int, inp: int, wq: mx.array, scales: mx.array, biases: mx.array,
                a: argparse.Namespace, timed: Callable[[Callable[[], mx.array], int], float]) -> list[float]:
    """µs of each of --builds' qmm_mma builds on m random rows: plain, norm (rms norm first), res
    (a residual added after), swiglu-res (silu(gate) * up first, then the residual)."""
    x = mx.random.normal((m, inp)).astype(mx.bfloat16)
    gate_up = mx.random.normal((m, 2 * inp)).astype(mx.bfloat16)
    res = mx.random.normal((m, out)).astype(mx.bfloat16)
    norm = (mx.ones((inp,), mx.bfloat16), 1e-6)
    mma = partial(quantized_matmul_mma, w=wq, scales=scales, biases=biases, group_size=a.group_size, bits=a.bits)
    fns = {"plain": lambda: mma(x), "norm": lambda: mma(x, norm=norm), "res": lambda: mma(x, res=res),
           "swiglu-res": lambda: mma(gate_up, swiglu=True, res=res)}
    return [timed(fns[b], a.launches) for b in a.builds.split(",")]


if __name__ == "__main__":
    main()
