"""What one verify of N rows costs, layer by layer, and the CPU's gates through 2^ against MLX's.

    python scripts/profile_layers.py [--model DIR] [--dtype float32] [--context 195] [--rows 1,7,17]
        [--reps 15] [--gates] [--json OUT.json]

A verify is the target's forward over a tree's rows (here a chain of N rows; N = 1 is the one-node
verify plain decoding runs) after `--context` committed tokens. Two measurements, each run
interleaved, medians over `--reps`:
- `layers`: every layer evaluated on its own (an mx.eval after each, so each includes one sync),
  then the final norm, the output projection and the argmax: where a row's cost goes. The same
  verify without the syncs is `whole`. For N > 1 also `commit`: the commit of the whole chain
  after its verify, with the GDN layers' commits joined (engine/cache.py COMMIT_TOGETHER, the
  engine's way) and each layer's alone, alternated.
- `--gates`: whole verifies with engine.cpu_exp.POW_GATES on (SiLU and sigmoid through 2^ on the
  CPU) and off (MLX's functions), alternated; prints both, their ratio, whether the greedy argmaxes
  agree and the largest logit difference. The switch is part of each layer's trace key and read
  when a forward is built, so it is set around every call (two copies of the model keep the
  comparison from sharing anything else, the KV cache included).
Runs on any MLX backend (the gates switch matters on the CPU only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402

from engine import cache as cache_module  # noqa: E402
from engine import cpu_exp, forward  # noqa: E402
from engine.cache import KVCache  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.tree import DraftTree  # noqa: E402

BUNDLED = Path(__file__).resolve().parents[1] / "engine" / "bundled" / "target"


def tree_of(rows: int) -> DraftTree:
    return DraftTree.single(7) if rows == 1 else DraftTree.chain(7, list(range(10, 10 + rows - 1)))


def logits_of(model, cache, tree: DraftTree, context: int, gates: bool = True) -> mx.array:
    saved, cpu_exp.POW_GATES = cpu_exp.POW_GATES, gates
    try:
        return forward.verify(model, cache, tree, context)
    finally:
        cpu_exp.POW_GATES = saved


def timed_whole(model, cache, tree: DraftTree, context: int, gates: bool = True) -> float:
    t0 = time.perf_counter()
    mx.eval(mx.argmax(logits_of(model, cache, tree, context, gates), axis=-1))
    return (time.perf_counter() - t0) * 1e3


def timed_layers(model, cache, tree: DraftTree, context: int) -> list[float]:
    """ms of each layer evaluated alone, then of the head (final norm, output projection, argmax)."""
    text = model.model
    batch = forward.tree_batch(tree, context, model.args.linear_conv_kernel_dim)
    h = text.embed_tokens(mx.array([list(tree.tokens)]))
    mx.eval(h)
    times, t0 = [], time.perf_counter()
    for layer, c in zip(text.layers, cache[: len(text.layers)], strict=True):
        h = layer(h, c, batch)
        mx.eval(h)
        t = time.perf_counter()
        times.append((t - t0) * 1e3)
        t0 = t
    h = text.norm(h)
    out = text.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)
    mx.eval(mx.argmax(out, axis=-1))
    times.append((time.perf_counter() - t0) * 1e3)
    return times


def timed_commit(model, cache, tree: DraftTree, context: int, together: bool) -> float:
    """ms of the commit of the whole chain after its verify (evaluated first), the GDN layers'
    commits joined (engine/cache.py COMMIT_TOGETHER) or each alone; the cache is rewound after."""
    marks = [c.mark() for c in cache]
    mx.eval(logits_of(model, cache, tree, context), forward.state_arrays(cache))
    saved, cache_module.COMMIT_TOGETHER = cache_module.COMMIT_TOGETHER, together
    try:
        t0 = time.perf_counter()
        forward.commit(cache, tree.path_to(tree.size - 1))
        ms = (time.perf_counter() - t0) * 1e3
    finally:
        cache_module.COMMIT_TOGETHER = saved
    for c, m in zip(cache, marks, strict=True):
        c.rewind(m)
    return ms


def loaded(path: str, dtype: str, context: int, kv_dtype: str | None = None) -> tuple:
    """The model and its cache holding `context` tokens, its K/V rows stored in `kv_dtype` (the
    compute dtype where None)."""
    model = load_model(path, dtype=dtype).model
    cache = model.make_cache()
    if kv_dtype is not None:
        for c in cache:
            if isinstance(c, KVCache):
                c.dtype = getattr(mx, kv_dtype)
    forward.extend(model, cache, [5 + i % 4000 for i in range(context)])
    return model, cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=195)
    ap.add_argument("--rows", default="1,7,17")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--kv-dtype", choices=["float32", "float16", "bfloat16"],
                    help="K/V rows stored in this dtype (default: the compute dtype)")
    ap.add_argument("--gates", action="store_true", help="also compare the CPU's gates through 2^ with MLX's")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    report: dict = {"device": str(mx.default_device()), "rows": {}}
    model, cache = loaded(a.model, a.dtype, a.context, a.kv_dtype)
    other = loaded(a.model, a.dtype, a.context, a.kv_dtype) if a.gates else None
    for n in rows:  # traces every shape once, both copies
        for _ in range(2):
            timed_whole(model, cache, tree_of(n), a.context)
            timed_layers(model, cache, tree_of(n), a.context)
            if other is not None:
                timed_whole(*other, tree_of(n), a.context, gates=False)
    print(f"{report['device']}, {a.dtype}, K/V {a.kv_dtype or a.dtype}, context {a.context}; ms, medians of {a.reps}")
    for n in rows:
        tree = tree_of(n)
        layers, whole, ours, theirs = [], [], [], []
        commits: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(a.reps):
            layers.append(timed_layers(model, cache, tree, a.context))
            whole.append(timed_whole(model, cache, tree, a.context))
            if n > 1:
                for together in (rep % 2 == 0, rep % 2 == 1):
                    commits[together].append(timed_commit(model, cache, tree, a.context, together))
            if other is not None:
                pair = [(ours, model, cache, True), (theirs, *other, False)]
                for out, m, c, gates in pair if rep % 2 else pair[::-1]:
                    out.append(timed_whole(m, c, tree, a.context, gates))
        per = [statistics.median(x[i] for x in layers) for i in range(len(layers[0]))]
        entry: dict = {"whole_ms": statistics.median(whole), "layers_ms": per[:-1], "head_ms": per[-1]}
        if n > 1:
            entry.update(commit_ms=statistics.median(commits[True]), commit_apart_ms=statistics.median(commits[False]))
        commit = f"; commit {entry['commit_ms']:.2f} (layers apart {entry['commit_apart_ms']:.2f})" if n > 1 else ""
        print(f"{n:3d} rows: whole {entry['whole_ms']:.2f}; layers " + " ".join(f"{v:.2f}" for v in per[:-1])
              + f"; head {per[-1]:.2f}{commit}")
        if other is not None:
            la, lb = logits_of(model, cache, tree, a.context), logits_of(*other, tree, a.context, gates=False)
            same = bool(mx.array_equal(mx.argmax(la, axis=-1), mx.argmax(lb, axis=-1)))
            diff = float(mx.abs(la - lb).max())
            entry.update(pow_gates_ms=statistics.median(ours), mlx_gates_ms=statistics.median(theirs),
                         argmax_equal=same, max_logit_diff=diff)
            print(f"           gates through 2^ {entry['pow_gates_ms']:.2f}, MLX's {entry['mlx_gates_ms']:.2f} "
                  f"({entry['pow_gates_ms'] / entry['mlx_gates_ms']:.3f}); argmaxes equal: {same}; "
                  f"max |logit difference| {diff:.1e}")
        report["rows"][n] = entry
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
