"""Where the host's time goes in one verify: building the lazy graph, evaluating it, the commit.

    python scripts/profile_host.py --out DIR [--shape 9b] [--layers 32] [--rows 1,2,17]

MLX evaluates nothing until `mx.eval`, so a verify's wall time is the host building its graph
(Python, compiled-function replay, array creation) and then the evaluation (the host encoding
every kernel while the device runs them). This script times the phases of one verify of the
engine's model, built in memory at a Qwen3.5 layer shape (random weights, as scripts/profile_gpu.py
builds it), for trees of each row count (a chain of up to 8 with siblings), each phase synchronised:

- `batch_ms`   the per-tree inputs alone (forward.tree_batch: positions, masks, conv taps);
- `build_ms`   the whole verify graph with every node's argmax, nothing evaluated;
- `eval_ms`    evaluating it, split into `encode_ms` (`mx.async_eval`'s return: the host encoding
               every launch, the device idle when it starts) and `wait_ms` (then waiting for the
               device to finish);
- `commit_build_ms` / `commit_eval_ms`  the commit of the chain, built then evaluated;
- `sync_ms`    evaluating an array that is already computed (the floor of any round trip).

Each commit is undone by a rewind, so every verify starts from the same committed length.
`--compile on,off` measures both ways in one process (off: the layers run their pure functions
and the GDN commit its ops or kernel call uncompiled, what compilation saves on the host); `sg0`
compiles layer by layer, a one-token pass not in segments (engine/models/segments.py), and a
repeated list (`on,sg0,on,sg0`) alternates the settings. A
cProfile of the builds of the largest row count goes to DIR/host_profile_N_<compile>.txt;
everything to DIR/host.json. `--new-sizes 9,10,...` then verifies tree sizes not seen before in
the process: the first verify of each (the compiled layers trace it) against later ones.
Runs on any MLX backend; on the CPU use --shape bundled.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from profile_gpu import build_model  # noqa: E402
from round_costs import chain_with_siblings  # noqa: E402
from shaped_checkpoint import SHAPES, bundled_text_config  # noqa: E402

from engine import forward  # noqa: E402
from engine.cache import GDNCache  # noqa: E402
from engine.kernels import backend_default  # noqa: E402
from engine.models import segments  # noqa: E402
from engine.models.layers import Batch  # noqa: E402
from engine.models.qwen3_5 import DecoderLayer  # noqa: E402


def phases(model: Any, cache: list, committed: int, n: int, runs: int, split: bool = False) -> dict[str, float]:
    """Median ms of each phase of `runs` verifies of an n-node tree (after two warm-ups); split:
    the commit timed by layer kind (each built and evaluated) instead of by building / evaluating."""
    tree = chain_with_siblings(n)
    path = tree.path_to(min(n - 1, 8))
    kernel = model.args.linear_conv_kernel_dim
    got: dict[str, list[float]] = {k: [] for k in ("batch_ms", "build_ms", "eval_ms", "commit_build_ms",
                                                   "commit_eval_ms", "sync_ms", "encode_ms", "wait_ms")}
    for r in range(runs + 2):
        marks = [c.mark() for c in cache]
        t0 = time.perf_counter()
        batch = forward.tree_batch(tree, committed, kernel)
        t1 = time.perf_counter()
        mx.eval(_batch_arrays(batch))
        t2 = time.perf_counter()
        choice = mx.argmax(forward.verify(model, cache, tree, committed), axis=-1)
        t3 = time.perf_counter()
        mx.async_eval(choice)
        t3e = time.perf_counter()
        mx.eval(choice)
        t4 = time.perf_counter()
        if split:  # "commit_build_ms" is then the GDN layers' commit, "commit_eval_ms" the others'
            forward.commit([c for c in cache if isinstance(c, GDNCache)], path)
            t5 = time.perf_counter()
            forward.commit([c for c in cache if not isinstance(c, GDNCache)], path)
            t6 = time.perf_counter()
        else:
            forward.commit(cache, path, evaluate=False)
            t5 = time.perf_counter()
            mx.eval(forward.state_arrays(cache))
            t6 = time.perf_counter()
        mx.eval(choice)
        t7 = time.perf_counter()
        for c, m in zip(cache, marks, strict=True):
            c.rewind(m)
        if r >= 2:
            for key, v in zip(got, (t1 - t0, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t3e - t3, t4 - t3e),
                              strict=True):
                got[key].append(v * 1e3)
    return {k: statistics.median(v) for k, v in got.items()}


def commit_probe(model: Any, cache: list, committed: int, n: int, runs: int) -> dict[str, float]:
    """Where a GDN commit's time goes, median ms over `runs` verifies of an n-node tree:
    - pending_eval_ms: evaluating every GDN layer's pending tree rows and states after the verify's
      own evaluation (anything left lazy by it shows here);
    - commit_ms: then the GDN layers' commit, built and evaluated;
    - each_layer_ms: the same commit with a synchronisation after every layer (summed), and
      layer_ms its median per layer."""
    tree = chain_with_siblings(n)
    path = tree.path_to(min(n - 1, 8))
    gdn = [c for c in cache if isinstance(c, GDNCache)]
    got: dict[str, list[float]] = {k: [] for k in ("pending_eval_ms", "commit_ms", "each_layer_ms", "layer_ms")}
    for r in range(2 * runs + 2):
        marks = [c.mark() for c in cache]
        mx.eval(mx.argmax(forward.verify(model, cache, tree, committed), axis=-1))
        t0 = time.perf_counter()
        mx.eval([a for c in gdn for a in (c.pending.x, c.pending.k, c.pending.u, c.pending.g, c.conv_state, c.state)])
        t1 = time.perf_counter()
        layer_times = []
        if r % 2 == 0:
            forward.commit(gdn, path)
        else:
            for c in gdn:
                t = time.perf_counter()
                forward.commit([c], path)
                layer_times.append(time.perf_counter() - t)
        t2 = time.perf_counter()
        forward.commit([c for c in cache if not isinstance(c, GDNCache)], path)
        for c, m in zip(cache, marks, strict=True):
            c.rewind(m)
        if r >= 2:
            got["pending_eval_ms"].append((t1 - t0) * 1e3)
            if r % 2 == 0:
                got["commit_ms"].append((t2 - t1) * 1e3)
            else:
                got["each_layer_ms"].append((t2 - t1) * 1e3)
                got["layer_ms"].append(statistics.median(layer_times) * 1e3)
    return {k: statistics.median(v) for k, v in got.items()}


def _batch_arrays(batch: Batch) -> list[mx.array]:
    arrays = [a for a in (batch.positions, batch.tree_mask) if a is not None]
    return arrays + (list(batch.gdn.arrays()) if batch.gdn is not None else [])


def first_use(model: Any, cache: list, committed: int, sizes: list[int], runs: int) -> dict[str, dict[str, float]]:
    """ms of the first verify of each tree size in this process (the layers' compiled functions
    trace it) against the median of `runs` more: what a tree size the loop has not seen costs once."""
    out = {}
    for n in sizes:
        tree = chain_with_siblings(n)
        times = []
        for _ in range(runs + 1):
            marks = [c.mark() for c in cache]
            t0 = time.perf_counter()
            mx.eval(mx.argmax(forward.verify(model, cache, tree, committed), axis=-1))
            times.append((time.perf_counter() - t0) * 1e3)
            for c, m in zip(cache, marks, strict=True):
                c.rewind(m)
        out[str(n)] = {"first_ms": times[0], "again_ms": statistics.median(times[1:])}
    return out


def profile_builds(model: Any, cache: list, committed: int, n: int, calls: int) -> str:
    """cProfile of `calls` verify builds of an n-node tree (each evaluated outside the profile)."""
    tree = chain_with_siblings(n)
    prof = cProfile.Profile()
    for _ in range(calls):
        marks = [c.mark() for c in cache]
        prof.enable()
        choice = mx.argmax(forward.verify(model, cache, tree, committed), axis=-1)
        prof.disable()
        mx.eval(choice)
        for c, m in zip(cache, marks, strict=True):
            c.rewind(m)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="9b", choices=("9b", "0.8b", "bundled"))
    ap.add_argument("--layers", type=int, default=0, help="layers to build (default: the shape's)")
    ap.add_argument("--bits", type=int, default=4, help="0 = unquantized")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 17])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--new-sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                    help="tree sizes not verified before: the first verify of each against later ones "
                         "(what tree sizes cost the compiled layers once), after everything else")
    ap.add_argument("--compile", default="on",
                    help="on, off, sg0 or a list (on,sg0,on,sg0 alternates): the layers' compiled functions; "
                         "sg0: compiled layer by layer, a one-token pass not in segments")
    ap.add_argument("--commit-split", action="store_true",
                    help="time the commit by layer kind: commit_build_ms = the GDN layers' (built and "
                         "evaluated), commit_eval_ms = the attention layers'")
    ap.add_argument("--commit-probe", action="store_true",
                    help="after the rest: where the GDN commit's time goes at the largest --rows (commit_probe)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    layers = args.layers or (bundled_text_config() if args.shape == "bundled" else SHAPES[args.shape])[
        "num_hidden_layers"]
    t0 = time.perf_counter()
    routed = backend_default("SPRUCE_QMM", on=("cuda", "cpu"))  # as the loader routes the quantized projections
    model = build_model(args.shape, layers, args.bits, getattr(mx, args.dtype), True, routed)
    print(f"built {layers} layers in {time.perf_counter() - t0:.1f} s", flush=True)
    cache = model.make_cache()
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, 8000, size=128)]
    forward.extend(model, cache, prompt)
    result: dict[str, Any] = dict(device=str(mx.default_device()), mlx=mx.__version__, shape=args.shape,
                                  layers=layers, dtype=args.dtype, bits=args.bits,
                                  date=time.strftime("%Y-%m-%d"), modes={})
    for i, mode in enumerate(args.compile.split(",")):
        DecoderLayer.compile_decode = GDNCache.compile_commit = mode != "off"
        segments.SEGMENTS = mode != "sg0"
        label = mode if mode not in result["modes"] else f"{mode}.{i}"  # a setting repeated to alternate
        rows = result["modes"][label] = {}
        for n in args.rows:
            rows[str(n)] = phases(model, cache, len(prompt), n, args.runs, args.commit_split)
            print(f"compile {mode} N={n}: " + ", ".join(f"{k} {v:.3f}" for k, v in rows[str(n)].items()), flush=True)
        (args.out / "host.json").write_text(json.dumps(result, indent=1))
        n = max(args.rows)
        text = profile_builds(model, cache, len(prompt), n, 10)
        (args.out / f"host_profile_{n}_{mode}.txt").write_text(text)
        print("\n".join(text.splitlines()[:24]), flush=True)
    DecoderLayer.compile_decode = GDNCache.compile_commit = segments.SEGMENTS = True
    if args.commit_probe:
        result["commit_probe"] = commit_probe(model, cache, len(prompt), max(args.rows), args.runs)
        print(f"commit probe N={max(args.rows)}: "
              + ", ".join(f"{k} {v:.3f}" for k, v in result["commit_probe"].items()), flush=True)
        (args.out / "host.json").write_text(json.dumps(result, indent=1))
    if args.new_sizes:
        result["first_use"] = first_use(model, cache, len(prompt), args.new_sizes, 5)
        for n, t in result["first_use"].items():
            print(f"first verify of N={n}: {t['first_ms']:.2f} ms, then {t['again_ms']:.2f}", flush=True)
        (args.out / "host.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
