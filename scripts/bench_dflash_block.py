"""A DFlash block over a long context, its attention two ways, side by side: the fused kernel over
the context buffer concatenated with the block's rows, and the split form the CPU uses
(engine/models/layers.py, attention_parts).

    python scripts/bench_dflash_block.py [--dflash DIR] [--lengths 64,2048,4000] [--runs 20]

For each context length the bundled DFlash drafter's context is filled with random feature rows,
then block passes (16 rows) alternate between the two ways; prints the median ms of each, their
ratio, and the max |difference| of the block's final hidden states.
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

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import engine.models.dflash as dflash_model  # noqa: E402
from engine.generate import BUNDLED  # noqa: E402
from engine.loader import load_dflash  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dflash", type=Path, default=BUNDLED / "dflash")
    ap.add_argument("--lengths", default="64,2048,4000")
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    model = load_dflash(a.dflash)
    c = model.config
    rng = np.random.default_rng(0)
    print("| context | fused over the concatenation, ms | split, ms | ratio | max abs diff |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in a.lengths.split(",")):
        cache = model.make_cache()
        feats = rng.standard_normal((n, len(c.target_layer_ids) * c.hidden_size)).astype(np.float32)
        model.append_context(mx.array(feats), cache)
        block = mx.array(rng.standard_normal((1, c.block_size, c.hidden_size)).astype(np.float32))
        mx.eval([x for kv in cache for x in kv.arrays()], block)

        # one compiled block per way (the switch is read when a block is traced), traced before timing
        ways = {}
        for split in (False, True):
            dflash_model.SPLIT_ON_CPU = split
            model._block_fn = ways[split] = mx.compile(model._block)
            mx.eval(model.block(block, cache))
        times: dict[bool, list[float]] = {False: [], True: []}
        outs = {}
        for _ in range(a.runs):
            for split in (False, True):
                model._block_fn = ways[split]
                t = time.perf_counter()
                outs[split] = model.block(block, cache)
                mx.eval(outs[split])
                times[split].append((time.perf_counter() - t) * 1e3)
        fused, split = statistics.median(times[False]), statistics.median(times[True])
        diff = float(mx.abs(outs[False] - outs[True]).max())
        print(f"| {n} | {fused:.2f} | {split:.2f} | {fused / split:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
