"""A DFlash block over a long context, its attention four ways, side by side: the fused kernel
over the context buffer concatenated with the block's rows, the split form (engine/models/layers.py,
attention_parts) with its softmax in MLX's operations or in the engine's own operation
(engine/cpu_ext.py SOFTMAX), and the whole attention in the engine's own operation, the CPU's way
(cpu_ext.draft_attention; switch cpu_ext.ATTENTION).

    python scripts/bench_dflash_block.py [--dflash DIR] [--lengths 64,2048,4000] [--runs 20]

For each context length the bundled DFlash drafter's context is filled with random feature rows,
then block passes (16 rows) alternate between the ways; prints the median ms of each, the ratios
to the attention operation, and the max |difference| of the block's final hidden states from it.
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
from engine import cpu_ext  # noqa: E402
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
    # (split form, softmax operation, attention operation) for each way; read when a block is traced
    ways = {"fused over the concatenation": (False, False, False), "split, softmax in ops": (True, False, False),
            "split, softmax operation": (True, True, False), "attention operation": (True, True, True)}
    base = "attention operation"
    print("| context | " + " | ".join(f"{w}, ms" for w in ways) + " | " + " | ".join(
        f"{w} / {base}" for w in ways if w != base) + " | max abs diff |")
    print("|---|" + "---|" * (2 * len(ways)))
    for n in (int(x) for x in a.lengths.split(",")):
        cache = model.make_cache()
        feats = rng.standard_normal((n, len(c.target_layer_ids) * c.hidden_size)).astype(np.float32)
        model.append_context(mx.array(feats), cache)
        block = mx.array(rng.standard_normal((1, c.block_size, c.hidden_size)).astype(np.float32))
        mx.eval([x for kv in cache for x in kv.arrays()], block)

        def setting(way: str) -> None:
            dflash_model.SPLIT_ON_CPU, cpu_ext.SOFTMAX, cpu_ext.ATTENTION = ways[way]

        compiled = {}
        for way in ways:  # one compiled block per way, traced before timing
            setting(way)
            key = (dflash_model.SPLIT_ON_CPU, cpu_ext.ATTENTION, cpu_ext.SOFTMAX)
            model._block_fns = {key: mx.compile(model._block)}
            compiled[way] = model._block_fns
            mx.eval(model.block(block, cache))
        times: dict[str, list[float]] = {w: [] for w in ways}
        outs = {}
        for _ in range(a.runs):
            for way in ways:
                setting(way)
                model._block_fns = compiled[way]
                t = time.perf_counter()
                outs[way] = model.block(block, cache)
                mx.eval(outs[way])
                times[way].append((time.perf_counter() - t) * 1e3)
        med = {w: statistics.median(t) for w, t in times.items()}
        diff = max(float(mx.abs(outs[w] - outs[base]).max()) for w in ways)
        print(f"| {n} | " + " | ".join(f"{med[w]:.2f}" for w in ways) + " | "
              + " | ".join(f"{med[w] / med[base]:.2f}x" for w in ways if w != base) + f" | {diff:.1e} |")
    dflash_model.SPLIT_ON_CPU, cpu_ext.SOFTMAX, cpu_ext.ATTENTION = True, True, True


if __name__ == "__main__":
    main()
