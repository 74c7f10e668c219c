"""Gated DeltaNet decode layers on CUDA, launched kernel by kernel through MLX against one launch
plan a layer (engine/launch_plan.py): what the host pays, what the device pays, and whether the
results are the same bits.

    python scripts/bench_launch_plan.py --out DIR [--shape 9b] [--layers 24] [--steps 32] [--runs 5]

A step is one token through `--layers` GDN decoder layers (engine/layer_plans.py: nine kernels a
layer), each with its own random 4-bit weights at the shape's sizes (the 9B
shape: hidden 4096, 16 / 32 heads of 128, MLP 12288; a 9B step has 24 such layers). Steps chain
(each step's results are the next step's inputs). Two timings a setting, the settings alternated
run by run in one process:

- synchronised steps: `build_ms` (the Python calls that make the step's graph), `encode_ms`
  (`mx.async_eval`: MLX evaluating the graph, which on CUDA is the host encoding the launches while
  the device starts running them) and `wait_ms` (the device finishing after that), medians;
- `pipelined_ms`: the steps queued back to back as the engine's pipelined decoding queues them
  (the next step built and handed over before the last is waited for), wall time a step.

The results of the last step of every run are compared bit for bit between the settings. Writes
DIR/launch_plan.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402

from engine.gdn.core import GDNShape  # noqa: E402
from engine.layer_plans import GDNLayer, gdn_decode_step, make_plan  # noqa: E402

SHAPES = {  # GDN layout, hidden, MLP width
    "9b": (GDNShape(Hk=16, Hv=32, Dk=128, Dv=128, K=4), 4096, 12288),
    "4b": (GDNShape(Hk=16, Hv=32, Dk=128, Dv=128, K=4), 2560, 9216),
    "small": (GDNShape(Hk=4, Hv=8, Dk=128, Dv=128, K=4), 1024, 3072),
}


def initial(shape: GDNShape, hidden: int, layers: int) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
    keys = mx.random.split(mx.random.key(11), 1 + 2 * layers)
    x = mx.random.normal((1, 1, hidden), key=keys[0]).astype(mx.bfloat16)
    states = [((mx.random.normal((shape.K - 1, shape.conv_dim), key=keys[1 + 2 * i]) * 0.5).astype(mx.bfloat16),
               mx.random.normal((shape.Hv, shape.Dv, shape.Dk), key=keys[2 + 2 * i]) * 0.1) for i in range(layers)]
    mx.eval(x, *[a for s in states for a in s])
    return x, states


def step(run_layer: Any, x: mx.array,
         states: list[tuple[mx.array, mx.array]]) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
    new = []
    for i, (conv, S) in enumerate(states):
        x, conv, S = run_layer(i, x, conv, S)
        new.append((conv, S))
    return x, new


def run(run_layer: Any, shape: GDNShape, hidden: int, layers: int, steps: int) -> dict[str, Any]:
    x, states = initial(shape, hidden, layers)
    build, encode, wait = [], [], []
    for _ in range(steps):  # synchronised
        t0 = time.perf_counter()
        x, states = step(run_layer, x, states)
        t1 = time.perf_counter()
        mx.async_eval(x, *[a for s in states for a in s])
        t2 = time.perf_counter()
        mx.eval(x, *[a for s in states for a in s])
        t3 = time.perf_counter()
        build.append(t1 - t0), encode.append(t2 - t1), wait.append(t3 - t2)
    t0 = time.perf_counter()
    for _ in range(steps):  # pipelined: handed over, not waited for
        x, states = step(run_layer, x, states)
        mx.async_eval(x, *[a for s in states for a in s])
    mx.eval(x, *[a for s in states for a in s])
    pipelined = (time.perf_counter() - t0) / steps
    ms = 1e3
    return {"build_ms": statistics.median(build) * ms, "encode_ms": statistics.median(encode) * ms,
            "wait_ms": statistics.median(wait) * ms, "pipelined_ms": pipelined * ms, "final": (x, states)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    shape, hidden, intermediate = SHAPES[args.shape]
    t0 = time.perf_counter()
    model = [GDNLayer.random(shape, hidden, intermediate, seed=i) for i in range(args.layers)]
    plans = [make_plan(layer, hidden, mx.bfloat16) for layer in model]
    print(f"{args.layers} layers, {plans[0].launches} launches a layer, built in {time.perf_counter() - t0:.1f} s",
          flush=True)
    settings = {
        "launches": lambda i, x, conv, S: gdn_decode_step(model[i], x, conv, S),
        "plan": lambda i, x, conv, S: tuple(plans[i](x, conv, S)),
    }
    for fn in settings.values():  # warm-up: compiles, allocator caches
        run(fn, shape, hidden, args.layers, 4)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    same = []
    for r in range(args.runs):
        finals = {}
        for name, fn in settings.items():
            res = run(fn, shape, hidden, args.layers, args.steps)
            finals[name] = res.pop("final")
            rows[name].append(res)
            print(f"run {r} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
        (xa, sa), (xb, sb) = finals["launches"], finals["plan"]
        pairs = [(xa, xb), *[(p, q) for s, t in zip(sa, sb, strict=True) for p, q in zip(s, t, strict=True)]]
        same.append(all(bool(mx.array_equal(p, q)) for p, q in pairs))
    summary = {name: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for name, rs in rows.items()}
    out = {"shape": args.shape, "layers": args.layers, "steps": args.steps, "runs": args.runs,
           "device": str(mx.default_device()), "launches_a_layer": plans[0].launches, "runs_detail": rows,
           "median": summary, "bitwise_equal_each_run": same}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch_plan.json").write_text(json.dumps(out, indent=1))
    print("| setting | build ms | encode ms | wait ms | pipelined ms a step |")
    print("|---|---|---|---|---|")
    for name, m in summary.items():
        print(f"| {name} | {m['build_ms']:.3f} | {m['encode_ms']:.3f} | {m['wait_ms']:.3f} | {m['pipelined_ms']:.3f} |")
    print(f"results bitwise equal in every run: {all(same)} ({same})")


if __name__ == "__main__":
    main()
