"""A tree verify over a long context with the attention's softmax two ways, side by side: through
MLX's exp (mx.softmax) and through its power (engine/cpu_exp.py, the CPU's default).

    python scripts/bench_tree_attention.py [--model DIR] [--lengths 64,1024,4000] [--nodes 17] [--runs 12]

For each context length (random ids, prefilled once), verifies of an N-node tree (a chain of up to
8 with siblings, as scripts/round_costs.py builds it) alternate between the two ways, each undone by
a rewind; prints the median ms of each, their ratio, and whether every node's argmax agrees. The
tree's rows attend in ops (engine/models/layers.py, Attention.attend), so on the CPU a long context
makes the softmax a large share of the verify.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from round_costs import chain_with_siblings  # noqa: E402

import engine.cpu_exp as cpu_exp  # noqa: E402
from engine import forward  # noqa: E402
from engine.generate import BUNDLED  # noqa: E402
from engine.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=BUNDLED / "target")
    ap.add_argument("--lengths", default="64,1024,4000")
    ap.add_argument("--nodes", type=int, default=17)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    model = load_model(str(a.model), a.dtype).model
    tree = chain_with_siblings(a.nodes)
    print(f"{mx.default_device()}, {a.nodes}-node verify, median ms of {a.runs} (after 2 warm-ups)")
    print("| context | mx.softmax | power | ratio | argmax equal |\n|---|---|---|---|---|")
    for length in (int(x) for x in a.lengths.split(",")):
        cache = model.make_cache()
        forward.extend(model, cache, [int(t) for t in np.random.RandomState(0).randint(0, 8000, size=length)])
        times: dict[bool, list[float]] = {False: [], True: []}
        choices: dict[bool, np.ndarray] = {}
        for _ in range(a.runs + 2):
            for pow_softmax in (False, True):
                cpu_exp.POW_EXP = pow_softmax
                marks = [c.mark() for c in cache]
                t0 = time.perf_counter()
                choice = mx.argmax(forward.verify(model, cache, tree, length), axis=-1)
                mx.eval(choice)
                times[pow_softmax].append((time.perf_counter() - t0) * 1e3)
                choices[pow_softmax] = np.array(choice)
                for c, m in zip(cache, marks, strict=True):
                    c.rewind(m)
        cpu_exp.POW_EXP = True
        exp_ms, pow_ms = (statistics.median(times[k][2:]) for k in (False, True))
        same = bool(np.array_equal(choices[False], choices[True]))
        print(f"| {length} | {exp_ms:.2f} | {pow_ms:.2f} | {exp_ms / pow_ms:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
