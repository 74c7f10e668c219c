"""A decode step's and a verify's attention on the CPU: the engine's own operation
(engine/cpu_ext.cpp rows_attention) against MLX's operations (attention_ops) and MLX's fused kernel.

    python scripts/bench_cpu_attention.py [--lengths 64,1024,4000,8000,32000] [--rows 1,7,17] [--reps 40]
    python scripts/bench_cpu_attention.py --kv float32,float16,bfloat16,int8 [--lengths 4000,16000,32000]

One attention layer of the bundled target's shape (6 query heads, 2 K/V heads of 64, float32) over
a view of a longer cache buffer, as KVCache hands it out; a verify's rows see the prefix and a
random tree's ancestors. Ten calls are evaluated together (as a step's layers follow each other),
µs a call, medians over --reps, the three forms interleaved rep by rep. Also the largest
difference from the operations' result.

`--kv`: the engine's operation alone over a cache stored in each of these dtypes (a half or 8-bit
cache, `--kv-dtype`, read in place), one call an evaluation with 64 MB read between calls, so that the
cache's rows come from memory as in a model's step, where the weights stream through the CPU's
caches; µs a call, medians of --reps, the dtypes interleaved, each against float32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402

from engine import cpu_ext, kv_int8  # noqa: E402
from engine.models.layers import attention_ops  # noqa: E402
from engine.tree import DraftTree  # noqa: E402

HEADS, KV_HEADS, DIM, CALLS = 6, 2, 64, 10


def stored(x: mx.array, name: str) -> mx.array:
    """x's rows as a cache of dtype `name` stores them (int8: packed with their scales)."""
    return kv_int8.pack(x) if name == "int8" else x.astype(getattr(mx, name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,1024,4000,8000,32000")
    ap.add_argument("--rows", default="1,7,17")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--kv", default="", help="K/V cache dtypes to compare the operation over, e.g. float32,float16")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    if cpu_ext.module() is None:
        sys.exit("engine/cpu_ext.cpp is not built here (a C++ compiler, Python's headers and nanobind are needed)")
    rng = np.random.default_rng(0)
    if a.kv:
        kv_table([int(x) for x in a.lengths.split(",")], a.kv.split(","), a.reps, rng)
        return
    print(f"{HEADS} heads, {KV_HEADS} K/V heads of {DIM}, float32; µs a call ({CALLS} evaluated together), "
          f"medians of {a.reps}")
    print("| keys | rows | engine's operation | MLX operations | MLX fused kernel | max difference |")
    print("|---|---|---|---|---|---|")
    for keys in (int(x) for x in a.lengths.split(",")):
        kbuf, vbuf = (mx.array(rng.standard_normal((1, KV_HEADS, keys + 64, DIM)).astype(np.float32)) for _ in range(2))
        for rows in (int(x) for x in a.rows.split(",")):
            k, v = kbuf[:, :, :keys], vbuf[:, :, :keys]
            q = mx.array(rng.standard_normal((1, HEADS, rows, DIM)).astype(np.float32))
            parents = (-1, *(int(rng.integers(0, i)) for i in range(1, rows)))
            seen = None if rows == 1 else mx.array(DraftTree(tuple(range(rows)), parents).ancestor_mask())
            prefix = keys - (0 if rows == 1 else rows)
            mask = None if seen is None else mx.concatenate([mx.ones((rows, prefix), dtype=mx.bool_), seen], axis=1)
            mx.eval(k, v, q, *([] if mask is None else [mask]))
            forms = {
                "ext": lambda: cpu_ext.rows_attention(q, k, v, DIM**-0.5, prefix, seen),  # noqa: B023
                "ops": lambda: attention_ops(q, k, v, DIM**-0.5, mask),  # noqa: B023
                "sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5, mask=mask),  # noqa: B023
            }
            times: dict[str, list[float]] = {name: [] for name in forms}
            for _ in range(a.reps):
                for name, f in forms.items():
                    t = time.perf_counter()
                    mx.eval([f() for _ in range(CALLS)])
                    times[name].append((time.perf_counter() - t) / CALLS * 1e6)
            diff = mx.max(mx.abs(forms["ext"]() - forms["ops"]())).item()
            print(f"| {keys} | {rows} | " + " | ".join(f"{statistics.median(times[n]):.1f}" for n in forms)
                  + f" | {diff:.1e} |")


def kv_table(lengths: list[int], names: list[str], reps: int, rng: np.random.Generator) -> None:
    """One decode row's operation over a cache of each dtype, its rows evicted between calls."""
    junk = mx.zeros((16 << 20,), dtype=mx.float32)  # 64 MB, more than the CPU's last-level cache
    mx.eval(junk)
    print(f"one row, {HEADS} heads, {KV_HEADS} K/V heads of {DIM}; µs a call (one an evaluation, 64 MB read "
          f"between calls), medians of {reps}")
    print("| keys | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for keys in lengths:
        kf, vf = (rng.standard_normal((1, KV_HEADS, keys + 64, DIM)).astype(np.float32) for _ in range(2))
        caches = {n: tuple(stored(mx.array(x), n)[:, :, :keys] for x in (kf, vf)) for n in names}
        q = mx.array(rng.standard_normal((1, HEADS, 1, DIM)).astype(np.float32))
        mx.eval(q, *(a for pair in caches.values() for a in pair))
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(reps):
            for n, (k, v) in caches.items():
                mx.eval((junk + 1.0).sum())
                t = time.perf_counter()
                mx.eval(cpu_ext.rows_attention(q, k, v, DIM**-0.5, keys))
                times[n].append((time.perf_counter() - t) * 1e6)
        med = {n: statistics.median(times[n]) for n in names}
        base = med.get("float32", med[names[0]])
        print(f"| {keys} | " + " | ".join(f"{med[n]:.1f} ({base / med[n]:.2f}x)" for n in names) + " |")


if __name__ == "__main__":
    main()
