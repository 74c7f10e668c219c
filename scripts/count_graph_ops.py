"""How many operations the host hands the device for one decode step, one tree verify and one MTP
draft depth, by kind: on a GPU each is an encoding the host does one by one, and a speculation
round on the H200 was measured bound by that, not by the device (BENCHMARKS.md, issue 12,
twenty-second session).

    python scripts/count_graph_ops.py [--model DIR] [--dtype auto] [--sizes 1,7,17] [--json OUT.json]

The graphs are MLX's own (mx.export_to_dot of the lazy outputs), so fused elementwise chains of
the compiled layer functions count once, and views (reshape, slice, transpose, broadcast, ...)
are counted apart: MLX runs most of them without a launch. Per-layer figures divide by the
target's layer count. Runs on any backend; the CPU's graphs differ from a GPU's (fast ops
decompose there, and the GDN kernels are GPU-only), so count on the GPU in question.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402

from engine import forward, warmup  # noqa: E402
from engine.config import EngineConfig, SpecConfig  # noqa: E402
from engine.drafters import make_drafter  # noqa: E402
from engine.drafters.mtp import MTPDrafter  # noqa: E402
from engine.generate import Engine  # noqa: E402

BUNDLED = Path(__file__).resolve().parents[1] / "engine" / "bundled" / "target"
# operations MLX usually runs without a launch (a view of its input's buffer)
VIEWS = {"Reshape", "Slice", "Transpose", "Broadcast", "BroadcastAxes", "ExpandDims", "Squeeze", "Unflatten",
         "Flatten", "AsStrided", "Split", "StopGradient", "Depends", "Copy"}


def count(outputs: list[mx.array]) -> collections.Counter[str]:
    """The operations of the lazy graph behind `outputs`, by primitive name."""
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        text = Path(f.name).read_text()
    return collections.Counter(re.findall(r'label ?="?([A-Za-z_][A-Za-z_0-9]*)', text))


def summary(ops: collections.Counter[str], layers: int) -> dict[str, object]:
    views = sum(n for k, n in ops.items() if k in VIEWS)
    total = sum(ops.values())
    return {"total": total, "views": views, "launching": total - views,
            "launching_per_layer": round((total - views) / layers, 1),
            "by_kind": dict(ops.most_common())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BUNDLED))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--sizes", default="1,7,17", help="tree sizes (1: a decode step)")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    engine = Engine(EngineConfig(model_path=a.model, dtype=a.dtype))
    model, layers = engine.model, engine.model.args.num_hidden_layers
    ids = [(17 * i + 3) % engine.vocab_size for i in range(40)]
    cache = engine.make_cache()
    forward.extend(model, cache, ids[:-1])
    report: dict[str, object] = {"model": a.model, "device": str(mx.default_device()), "layers": layers}
    for n in [int(s) for s in a.sizes.split(",") if s]:
        tree = warmup.chain_with_siblings(ids[-1], n, min(n - 1, 6), engine.vocab_size)
        marks = [c.mark() for c in cache]
        for second in (False, True):  # the second verify has the first's commit folded in (GPUs)
            logits = forward.verify(model, cache, tree, len(ids) - 1 + (n if second else 0))
            outputs = [logits, *forward.state_arrays(cache)]
            if second:
                report[f"verify_{n}"] = summary(count(outputs), layers)
            mx.eval(outputs)
            forward.commit(cache, tree.path_to(n - 1) if n > 1 else [0])
        for c, m in zip(cache, marks, strict=True):
            c.rewind(m)
    try:
        drafter = make_drafter(engine, SpecConfig(method="mtp", tree="chain"))
    except Exception as e:  # noqa: BLE001 - a checkpoint without an MTP head: no depth to count
        print(f"no MTP depth: {e}")
    else:
        assert isinstance(drafter, MTPDrafter) and drafter.steps is not None
        head = drafter.head
        hcache = head.make_cache()
        H, dtype = model.args.hidden_size, model.model.embed_tokens.weight.dtype
        # the head's rows in the target's dtype, as the drafter hands them over: float32 rows made
        # every matmul of the depth cast its weights (13 casts a depth counted on the H200)
        y = head(mx.zeros((1, 8, H), dtype), mx.ones((1, 8, H), dtype), hcache)[:, -1:]
        mx.eval(y, [x for c in hcache for x in c.arrays()])
        depths = drafter.steps.begin(hcache, 16)
        read = depths.read(y)
        report["mtp_read_k16"] = summary(count([read.ids, read.logp, read.token]), 1)
        report["mtp_advance"] = summary(count([depths.advance(read.token, y)]), 1)
    for name, r in report.items():
        if isinstance(r, dict):
            print(f"{name:<14} total {r['total']:5d}  views {r['views']:5d}  launching {r['launching']:5d}"
                  f"  ({r['launching_per_layer']} a layer)  {list(r['by_kind'].items())[:12]}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
