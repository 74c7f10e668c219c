"""Where a verify's graph nodes come from: the nodes by kind, and the view-making calls (reshape,
squeeze, split, indexing, ...) by the line that made them.

    python scripts/view_sites.py [--shape 9b] [--layers 4] [--rows 1,17] [--repo DIR]

count_graph_ops.py says how many nodes of each kind a decode step and a verify hand the host;
this says which lines to change. A view costs no launch, but each node is a step of the host's
evaluation, and on the H200 the host's encoding bounds a 9B-shaped decode step (BENCHMARKS.md,
issue 13). The model is profile_gpu.py's: random 4-bit weights at a Qwen3.5 shape, wired as the
loader wires it (fused and routed projections). Runs on any backend; the GDN kernels and the
CUDA matmul appear on a GPU only, so look on the GPU in question. `--repo` runs another checkout's
engine (e.g. an older commit unpacked with `git archive REV engine scripts | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="9b")
    ap.add_argument("--layers", type=int, default=4, help="enough for each layer kind (3 GDN + 1 attention)")
    ap.add_argument("--rows", default="1,17", help="tree sizes (chains) to verify")
    ap.add_argument("--top", type=int, default=30, help="call sites to list a verify")
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    a = ap.parse_args()
    repo = a.repo.resolve()
    sys.path[:0] = [str(repo), str(repo / "scripts")]
    if repo != Path(__file__).resolve().parents[1]:  # the other checkout's engine, not this one's
        for name in [m for m in sys.modules if m == "engine" or m.startswith("engine.")]:
            del sys.modules[name]

    import mlx.core as mx
    import numpy as np
    from count_graph_ops import count as count_ops
    from profile_gpu import build_model

    from engine import forward
    from engine.kernels import backend_default
    from engine.tree import DraftTree

    dtype = mx.bfloat16 if mx.default_device() != mx.cpu else mx.float32
    model = build_model(a.shape, a.layers, 4, dtype, True, backend_default("SPRUCE_QMM", on=("cuda", "cpu")))
    cache = model.make_cache()
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, 8000, size=64)]
    forward.extend(model, cache, prompt)

    sites: collections.Counter[tuple[str, str]] = collections.Counter()
    recording = [False]

    def wrap(owner: Any, name: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if recording[0]:
                caller = traceback.extract_stack(limit=2)[0]
                where = caller.filename.removeprefix(str(repo) + "/")
                sites[(name, f"{where}:{caller.lineno}")] += 1
            return original(*args, **kwargs)

        setattr(owner, name, recorded)

    for name in ("reshape", "squeeze", "transpose", "swapaxes", "__getitem__"):
        wrap(mx.array, name)
    for name in ("reshape", "squeeze", "expand_dims", "split", "transpose", "contiguous", "broadcast_to"):
        wrap(mx, name)
    for n in (int(r) for r in a.rows.split(",")):
        tree = DraftTree.chain(5, list(range(6, 5 + n)))
        sites.clear()
        recording[0] = True
        out = forward.verify(model, cache, tree, len(prompt))
        recording[0] = False
        kinds = count_ops([out])
        # a verify of several rows is handed to the device every few layers (forward.verify_eval_every):
        # its graph then holds the last stretch of layers only
        print(f"== {n}-row verify, {a.layers} layers, {mx.default_device()}: {sum(kinds.values())} nodes; "
              + ", ".join(f"{k} {v}" for k, v in kinds.most_common(16)), flush=True)
        for (name, where), count in sites.most_common(a.top):
            print(f"  {count:4d} {name:12s} {where}")
        mx.eval(out)


if __name__ == "__main__":
    main()
