"""Micro-benchmark: GDN tree verify, per-node loop vs dense form, for one layer.

Usage: python scripts/bench_gdn_tree.py [--hv 12] [--dk 32] [--dv 32] [--sizes 1,8,16,32,64]
On Linux CPU, preload OpenBLAS first (see the repo notes) or MLX matmuls are slow.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx
import numpy as np

from engine.gdn.ops import commit_fold, tree_dense
from engine.gdn.reference import commit_replay, tree_sequential
from engine.tree import DraftTree


def make_tree(shape: str, n: int, rng: np.random.Generator) -> DraftTree:
    if shape == "chain":
        parents = [-1, *range(n - 1)]
    else:  # random: each node hangs under a random earlier node (bushy, shallow-ish)
        parents = [-1] + [int(rng.integers(i)) for i in range(1, n)]
    return DraftTree(tuple(range(n)), tuple(parents))


def layer_inputs(n: int, hv: int, dk: int, dv: int, rng: np.random.Generator) -> list[mx.array]:
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    arrays = [
        unit(rng.normal(size=(n, hv, dk))) / np.sqrt(dk),
        unit(rng.normal(size=(n, hv, dk))),
        rng.normal(size=(n, hv, dv)),
        -rng.uniform(0.01, 1.0, size=(n, hv)),
        rng.uniform(size=(n, hv)),
        rng.normal(size=(hv, dv, dk)),
    ]
    out = [mx.array(a.astype(np.float32)) for a in arrays]
    mx.eval(out)
    return out


def time_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median wall time of fn() including evaluation of its (lazy) result."""
    mx.eval(fn())  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def bench(n: int, shape: str, hv: int, dk: int, dv: int, rng: np.random.Generator) -> dict[str, float]:
    tree = make_tree(shape, n, rng)
    q, k, v, g, beta, S0 = layer_inputs(n, hv, dk, dv, rng)
    mask, path = tree.ancestor_mask(), tree.path_to(n - 1)
    _, u = tree_dense(q, k, v, g, beta, mask, S0)
    return {
        "sequential": time_ms(lambda: tree_sequential(q, k, v, g, beta, tree.parents, S0)),
        "dense_blocked": time_ms(lambda: tree_dense(q, k, v, g, beta, mask, S0, solver="blocked")),
        "dense_subst": time_ms(lambda: tree_dense(q, k, v, g, beta, mask, S0, solver="substitution")),
        "commit_fold": time_ms(lambda: commit_fold(k, u, g, path, S0)),
        "commit_replay": time_ms(lambda: commit_replay(k, v, g, beta, path, S0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hv", type=int, default=12)
    ap.add_argument("--dk", type=int, default=32)
    ap.add_argument("--dv", type=int, default=32)
    ap.add_argument("--sizes", default="1,8,16,32,64")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"device {mx.default_device()}, Hv={args.hv} Dk={args.dk} Dv={args.dv}; median ms per layer call")
    cols = ["sequential", "dense_blocked", "dense_subst", "commit_fold", "commit_replay"]
    print(f"{'shape':>6} {'N':>3} " + " ".join(f"{c:>13}" for c in cols))
    for shape in ("chain", "random"):
        for n in (int(s) for s in args.sizes.split(",")):
            row = bench(n, shape, args.hv, args.dk, args.dv, rng)
            print(f"{shape:>6} {n:>3} " + " ".join(f"{row[c]:>13.3f}" for c in cols))


if __name__ == "__main__":
    main()
