"""The GDN commit of one round on its own: every GDN layer of a model folds an accepted path,
one kernel launch a layer against one launch for all layers, eager and compiled (the engine's
own functions: engine/cache.py commit_function, commit_layers_function).

    python scripts/bench_commit.py [--shape 9b] [--layers 24] [--nodes 17] [--path 9] [--runs 30]

Random tree rows and states of the shape's GDN layers (as a 17-node verify leaves them), then for
each way of committing, medians over `--runs`:
- `build_ms`  building the lazy commit of all layers (the host's share: MLX assembles a custom
  kernel's call on every eager call; a compiled function replays its trace);
- `eval_ms`   evaluating it (the launches and the device's work, one host sync);
- `queued_ms` one commit's share of `--queue` commits evaluated together (the device's work with
  the launch latency hidden behind the queue).
Needs a GPU backend (the kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cache import commit_function, commit_layers_function  # noqa: E402
from engine.gdn.core import GDNShape, TreeRows  # noqa: E402
from engine.kernels import KernelCore, gpu_backend  # noqa: E402

SHAPES = {"9b": GDNShape(Hk=16, Hv=32, Dk=128, Dv=128, K=4), "0.8b": GDNShape(Hk=16, Hv=16, Dk=128, Dv=128, K=4),
          "bundled": GDNShape(Hk=6, Hv=12, Dk=32, Dv=32, K=4)}


def layer_inputs(s: GDNShape, n: int, rng: np.random.Generator) -> tuple[TreeRows, mx.array, mx.array]:
    def arr(*shape: int, dtype: Any = mx.float32, scale: float = 1.0) -> mx.array:
        return mx.array((rng.normal(size=shape) * scale).astype(np.float32)).astype(dtype)

    rows = TreeRows(x=arr(n, s.conv_dim, dtype=mx.bfloat16), k=arr(n, s.Hv, s.Dk, scale=0.1),
                    u=arr(n, s.Hv, s.Dv, scale=0.1), g=arr(n, s.Hv, scale=0.1))
    return rows, arr(s.K - 1, s.conv_dim, dtype=mx.bfloat16), arr(s.Hv, s.Dv, s.Dk, scale=0.3)


def timed(commit: Callable[[], list[Any]], runs: int, queue: int) -> dict[str, float]:
    builds, evals, queued = [], [], []
    for _ in range(runs + 3):
        t0 = time.perf_counter()
        out = commit()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        builds.append((t1 - t0) * 1e3)
        evals.append((t2 - t1) * 1e3)
    for _ in range(5):
        t0 = time.perf_counter()
        mx.eval([commit() for _ in range(queue)])
        queued.append((time.perf_counter() - t0) * 1e3 / queue)
    return {"build_ms": statistics.median(builds[3:]), "eval_ms": statistics.median(evals[3:]),
            "queued_ms": statistics.median(queued)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="9b", choices=tuple(SHAPES))
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--nodes", type=int, default=17)
    ap.add_argument("--path", type=int, default=9)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--queue", type=int, default=10)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    backend = gpu_backend()
    if backend is None:
        sys.exit("bench_commit needs a GPU backend")
    core, s = KernelCore(backend), SHAPES[a.shape]
    rng = np.random.default_rng(0)
    layers = [layer_inputs(s, a.nodes, rng) for _ in range(a.layers)]
    mx.eval(layers)
    path = mx.array(list(range(a.path)), dtype=mx.int32)  # a chain from the root: its shape is what counts

    def each(compiled: bool) -> list[Any]:
        commit = commit_function(core, compiled)
        return [commit(r.x, r.k, r.u, r.g, path, c, S) for r, c, S in layers]

    flat = [a for r, c, S in layers for a in (r.x, r.k, r.u, r.g, c, S)]

    def together(compiled: bool) -> list[Any]:
        return commit_layers_function(core, compiled)(path, *flat)

    ways = {"one launch a layer": partial(each, False), "one launch a layer, compiled": partial(each, True),
            "one launch for all layers": partial(together, False),
            "one launch for all layers, compiled": partial(together, True)}
    result: dict[str, Any] = {"device": str(mx.default_device()), "shape": a.shape, "layers": a.layers,
                              "nodes": a.nodes, "path": a.path, "date": time.strftime("%Y-%m-%d"), "ways": {}}
    for name, fn in ways.items():
        result["ways"][name] = {k: round(v, 4) for k, v in timed(fn, a.runs, a.queue).items()}
        print(name, result["ways"][name], flush=True)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
