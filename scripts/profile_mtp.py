"""Where an MTP draft's time goes: each piece of one head depth timed alone, then the depths queued
as the drafter queues them on a GPU (all depths in one graph, one evaluation).

    python scripts/profile_mtp.py [--model DIR] [--dtype bfloat16] [--context 256] [--k 16,32]
        [--depths 6] [--reps 20] [--json OUT.json]

The head's cache is filled with `--context` rows from random inputs (what a catch-up writes), so
the timings are the model's shape's, not a prompt's. Pieces, median ms over `--reps` (each one
evaluated on its own, so each includes one launch-and-sync round trip; the `sync` row is that
round trip alone, an evaluation of a one-element add):
- `lm_head`        the target's lm_head on one row (the draft vocabulary's rows where the
                   checkpoint has one);
- `argpartition`, `argsort`, `logsumexp`  the pieces of `top_k_logp` on one fp32 row of that width;
- `read`           a depth's read: lm_head, top-k log-probabilities and the argmax, compiled;
- `advance`        a depth's head row (engine/drafters/mtp_steps.py CompiledDepths), compiled;
- `depth`          read + advance, one evaluation;
- `catch_up_N`     the head's append of N committed rows (MTPHead.append through its cache);
- `draft_D`        D depths queued as the drafter queues them (CompiledDepths), one evaluation,
                   and the same per depth;
- with `--compare-fuse`, that draft at k = 16 for two heads loaded side by side, the projections
                   separate and fused (MTPHead.fuse_projections), alternating five times.
Made for the H200 with scripts/widen_checkpoint.py's 9B-wide pair; runs on any MLX backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from bench_gdn_tree import time_ms  # noqa: E402

from engine.config import EngineConfig, SpecConfig  # noqa: E402
from engine.drafters import make_drafter  # noqa: E402
from engine.drafters.marginals import logsumexp_rows  # noqa: E402
from engine.drafters.mtp import MTPDrafter  # noqa: E402
from engine.drafters.mtp_steps import CompiledSteps  # noqa: E402
from engine.generate import Engine  # noqa: E402
from engine.loader import load_mtp  # noqa: E402
from engine.models.mtp import MTPHead  # noqa: E402

BUNDLED = Path(__file__).resolve().parents[1] / "engine" / "bundled" / "target"


def filled(head: MTPHead, e: mx.array, h: mx.array) -> tuple[list, mx.array]:
    """A fresh head cache holding the rows of (e, h) [1, T, H], as a catch-up writes them -> (the
    cache, the head's output at the last row [1, 1, H]), evaluated."""
    cache = head.make_cache()
    y = head(e, h, cache)[:, -1:]
    mx.eval(y, [x for c in cache for x in c.arrays()])
    return cache, y


def queued_draft(steps: CompiledSteps, cache: list, y: mx.array, k: int, depths: int) -> Callable[[], list[mx.array]]:
    """`depths` depths queued as the drafter queues them on a GPU, for one evaluation."""

    def draft() -> list[mx.array]:
        d, yy, outs = steps.begin(cache, k), y, []
        r = d.read(yy)
        outs += [r.ids, r.logp]
        for _ in range(depths - 1):
            yy = d.advance(r.token, yy)
            r = d.read(yy)
            outs += [r.ids, r.logp]
        return outs

    return draft


def compare_fuse(engine: Engine, drafter: MTPDrafter, e: mx.array, h: mx.array, depths: int,
                 reps: int) -> dict[str, float]:
    """The queued draft (k = 16) with the head's projections separate and fused (two heads loaded
    side by side), alternating five times: median ms of each."""
    args, path = engine.model.args, engine.config.model_path
    runs: dict[str, Callable[[], list[mx.array]]] = {}
    for fuse in (False, True):
        head = load_mtp(path, args, engine.dtype, fuse=fuse)
        cache, y = filled(head, e, h)
        steps = CompiledSteps(drafter.logits, drafter.embed, head, depths - 1, drafter.vocab_ids)
        runs["fused" if fuse else "separate"] = queued_draft(steps, cache, y, 16, depths)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(5):
        for name, run in runs.items():
            times[name].append(time_ms(run, max(3, reps // 5)))
    return {f"draft{depths}_k16_{name}": statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BUNDLED))
    p.add_argument("--dtype", default="auto", help="the engine's dtype")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--k", default="16,32", help="top-k widths to time (the drafter's is min(budget, 32))")
    p.add_argument("--depths", type=int, default=6)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--compare-fuse", action="store_true",
                   help="also time the queued draft with the head's projections separate and fused, alternating")
    a = p.parse_args()

    engine = Engine(EngineConfig(model_path=a.model, dtype=a.dtype))
    drafter = make_drafter(engine, SpecConfig(method="mtp", tree="chain"))
    assert isinstance(drafter, MTPDrafter)
    head, H = drafter.head, engine.model.args.hidden_size
    dtype = engine.model.model.embed_tokens.weight.dtype
    rng = np.random.default_rng(0)
    e, h = (mx.array(rng.standard_normal((1, a.context, H)).astype(np.float32)).astype(dtype) for _ in range(2))
    cache, y = filled(head, e, h)
    width = drafter.logits(y).shape[-1]
    row = mx.array(rng.standard_normal(width).astype(np.float32))
    steps = CompiledSteps(drafter.logits, drafter.embed, head, a.depths - 1, drafter.vocab_ids)
    one = mx.array(1.0)
    results: dict[str, float] = {"sync": time_ms(lambda: one + 1, a.reps), "lm_head": time_ms(
        lambda: drafter.logits(y), a.reps)}
    for k in [int(s) for s in a.k.split(",") if s]:
        results[f"argpartition_k{k}"] = time_ms(lambda k=k: mx.argpartition(-row, k - 1)[:k], a.reps)
        results[f"read_k{k}"] = time_ms(lambda k=k: steps.begin(cache, k).read(y).ids, a.reps)

        def depth(k: int = k) -> list[mx.array]:
            d = steps.begin(cache, k)
            r = d.read(y)
            return [r.ids, r.logp, d.advance(r.token, y)]

        results[f"depth_k{k}"] = time_ms(depth, a.reps)

        results[f"draft{a.depths}_k{k}"] = time_ms(queued_draft(steps, cache, y, k, a.depths), a.reps)
    results["argsort"] = time_ms(lambda: mx.argsort(-row), a.reps)
    results["logsumexp"] = time_ms(lambda: logsumexp_rows(row), a.reps)
    results["advance"] = time_ms(lambda: steps.begin(cache, 8).advance(mx.array([[3]]), y), a.reps)
    for n in (1, 4):
        ids = mx.array([[int(t) for t in rng.integers(0, engine.vocab_size, size=n)]])
        hidden = h[:, :n]

        def catch_up(ids: mx.array = ids, hidden: mx.array = hidden) -> list[mx.array]:
            marks = [c.mark() for c in cache]
            out = head.append(drafter.embed(ids), hidden, cache)
            arrays = [out, *(x for c in cache for x in c.arrays())]
            mx.eval(arrays)
            for c, m in zip(cache, marks, strict=True):
                c.rewind(m)
            return arrays

        results[f"catch_up_{n}"] = time_ms(catch_up, a.reps)
    if a.compare_fuse:
        results.update(compare_fuse(engine, drafter, e, h, a.depths, a.reps))
    device = str(mx.default_device())
    print(f"MTP draft pieces, {a.model} ({dtype}), context {a.context}, lm_head width {width}, {device}")
    for name, ms in results.items():
        print(f"  {name:<22} {ms:8.3f} ms")
    for k in [int(s) for s in a.k.split(",") if s]:
        total = results[f"draft{a.depths}_k{k}"]
        print(f"  draft of {a.depths} depths at k={k}: {total / a.depths:.3f} ms a depth")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "dtype": str(dtype), "context": a.context,
                                            "width": width, "device": device, "ms": results}, indent=1))


if __name__ == "__main__":
    main()
