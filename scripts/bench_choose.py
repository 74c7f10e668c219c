"""What a node's choice costs on a GPU: MLX's operations (engine/device_sampler.py) against the one
launch of engine/choose_kernel.py (issue 13: a sampled 9B-shaped step ran at 0.90-0.92x greedy on
an H100, the choice's ~20 operations ~0.3 ms of the host's encoding a step).

    python scripts/bench_choose.py [--vocab 248320] [--rows 1,17] [--dtype bfloat16] [--runs 30]
        [--choices 8]

For each row count and each setting (the bundled model's default sampling: temperature 0.7,
top-k 20, top-p 0.8; greedy with the controller's top-token probability), `--choices` independent
choices from random logits are built into one graph, handed to the device and evaluated; medians
of `--runs` of the host's time to build the graph, to hand it over (mx.async_eval's return: the
encoding of every launch) and to evaluate it in all, per choice, the two paths alternated run by
run in one process. The kernel's draws are also compared with the operations' on the same rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from bench_op_costs import timed  # noqa: E402

from engine import choose_kernel, device_sampler  # noqa: E402
from engine.config import SamplingParams  # noqa: E402

SETTINGS = {"sampled": SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=0),
            "greedy+top": SamplingParams()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--rows", default="1,17")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--choices", type=int, default=8)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    print(f"device {mx.default_device()}, vocab {args.vocab}, {args.dtype}, {args.choices} choices a graph, "
          f"medians of {args.runs}")
    print("\n| rows | setting | ops: build / hand over / evaluate, us a choice | kernel: the same | "
          "kernel's draws equal to the ops' |\n|---|---|---|---|---|")
    for n in (int(r) for r in args.rows.split(",")):
        logits = [(mx.random.normal((n, args.vocab)) * 3.0).astype(dtype) for _ in range(args.choices)]
        uniforms = [device_sampler.node_uniforms(j, range(100, 100 + n)) for j in range(args.choices)]
        mx.eval(logits, uniforms)
        for name, params in SETTINGS.items():
            raw = name == "greedy+top"

            def build(kernel: bool, params: SamplingParams = params, raw: bool = raw, logits: list[mx.array] = logits,
                      uniforms: list[mx.array] = uniforms) -> list[mx.array]:
                choose_kernel.KERNEL.value = kernel
                out = []
                for x, u in zip(logits, uniforms):
                    tokens, top = device_sampler.choose_and_top(x, params, None if params.greedy else u,
                                                                x if raw else None)
                    out += [tokens] if top is None else [tokens, top]
                return out

            cells = {}
            for kernel in (False, True, False, True):  # alternated, the second of each kept
                cells[kernel] = timed(lambda kernel=kernel: build(kernel), args.runs)
            same = np.mean([np.array_equal(np.array(a), np.array(b))
                            for a, b in zip(build(False)[::1 + raw], build(True)[::1 + raw])])
            choose_kernel.KERNEL.value = None

            def fmt(t: tuple[float, float, float]) -> str:
                return " / ".join(f"{1e3 * v / args.choices:.1f}" for v in t)

            print(f"| {n} | {name} | {fmt(cells[False])} | {fmt(cells[True])} | {same:.2f} of graphs |", flush=True)


if __name__ == "__main__":
    main()
