"""Prefill throughput of a long prompt: Spruce's matmul routes and chunk sizes side by side, and
mlx-lm in the same run.

    python scripts/bench_prefill.py --model DIR [--tokens 4096] [--chunks 512,2048]
                                    [--dequant-rows 64,off] [--runs 3] [--no-mlx-lm] [--out FILE]
                                    [--variants engine,cx0]

DIR: an MLX-layout checkpoint (e.g. `python scripts/shaped_checkpoint.py DIR --shape 9b`, the
Qwen3.5-9B shape in 4-bit). Each variant is one (chunk, dequant-rows) pair: `dequant-rows` is the
row count from which the model's quantized projections dequantize their weight and run a GEMM
(engine.qmm.CUDA_DEQUANT_ROWS on CUDA, CPU_DEQUANT_ROWS on the CPU); `off` keeps MLX's
quantized matmul for every row count above the small-M kernel's. The variants run interleaved,
`--runs` times each after a warm-up; prints the median tok/s of each (prompt of random ids, fresh
caches every run, prefix cache off) and a split of one chunk into its GDN and attention layers'
time (MLP included; each layer evaluated on its own) for the first chunk size of each route.
`--variants` runs each Spruce variant under each engine variant too (scripts/variants.py's
suffixes, e.g. cx0: the CPU's softmax in MLX's operations), interleaved.
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

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[1]

from engine import forward, kernels, qmm  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.generate import Engine  # noqa: E402
from engine.models.layers import CHAIN  # noqa: E402
from scripts.variants import variant_setting  # noqa: E402

OFF = 1 << 30  # a row count no chunk reaches


def set_dequant_rows(rows: int) -> None:
    if kernels.gpu_backend() == "cuda":
        qmm.CUDA_DEQUANT_ROWS = rows
    else:
        qmm.CPU_DEQUANT_ROWS = rows


def spruce_tok_s(engine: Any, ids: list[int], chunk: int) -> float:
    cache = engine.model.make_cache()
    t0 = time.perf_counter()
    forward.extend(engine.model, cache, ids, chunk)
    return len(ids) / (time.perf_counter() - t0)


def mlx_lm_tok_s(model: Any, ids: list[int], chunk: int) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for i in range(0, len(ids), chunk):
        mx.eval(model(mx.array([ids[i : i + chunk]]), cache=cache))
    return len(ids) / (time.perf_counter() - t0)


def layer_split(engine: Any, ids: list[int], chunk: int) -> dict[str, float]:
    """ms of each layer kind over one chunk after the first (each layer evaluated on its own, so
    the sum is a little above the pipelined chunk)."""
    model = engine.model
    cache = model.make_cache()
    forward.extend(model, cache, ids[:chunk], chunk)
    inner = model.model
    h = inner.embed_tokens(mx.array([ids[chunk : 2 * chunk]]))
    mx.eval(h)
    spent: dict[str, float] = {}
    for layer, c in zip(inner.layers, cache, strict=True):
        t0 = time.perf_counter()
        h = layer(h, c, CHAIN)
        mx.eval(h, c.arrays())
        kind = "attention layers" if layer.is_attention else "GDN layers"
        spent[kind] = spent.get(kind, 0.0) + (time.perf_counter() - t0) * 1e3
    return {k: round(v, 2) for k, v in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunks", default="512,2048")
    ap.add_argument("--dequant-rows", default="64,off")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--no-split", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--variants", default="engine", help="engine variants (scripts/variants.py), e.g. engine,cx0")
    a = ap.parse_args()
    settings = list(dict.fromkeys(a.variants.split(",")))
    engine = Engine(EngineConfig(model_path=str(a.model), dtype=a.dtype, prefix_cache=False,
                                 max_context=a.tokens + 64))
    ids = [int(t) for t in np.random.RandomState(1).randint(0, min(engine.vocab_size, 8000), size=a.tokens)]
    chunks = [int(c) for c in a.chunks.split(",")]
    routes = [OFF if r == "off" else int(r) for r in a.dequant_rows.split(",")]
    variants = [(c, r) for r in routes for c in chunks]
    ref = None
    if not a.no_mlx_lm:
        from mlx_lm import load

        ref = load(str(a.model))[0]
    got: dict[str, list[float]] = {}

    def run(name: str, fn: Any) -> None:
        got.setdefault(name, []).append(fn())

    for r in range(a.runs + 1):
        for chunk, rows in variants:
            set_dequant_rows(rows)
            for v in settings:
                tag = f" ({v})" if len(settings) > 1 else ""
                with variant_setting(f"x-{v}" if v != "engine" else "x"):
                    run(f"spruce chunk {chunk}, dequant from {'off' if rows == OFF else rows} rows{tag}",
                        lambda chunk=chunk: spruce_tok_s(engine, ids, chunk))
        if ref is not None:
            run("mlx-lm chunk 2048", lambda: mlx_lm_tok_s(ref, ids, 2048))
        if r == 0:
            got.clear()  # the warm-up: compilation, allocation
    result: dict[str, Any] = {"device": str(mx.default_device()), "tokens": a.tokens, "runs": a.runs,
                              "date": time.strftime("%Y-%m-%d"),
                              "tok_s": {k: round(statistics.median(v), 1) for k, v in got.items()}}
    if not a.no_split:
        result["split_ms"] = {}
        for rows in routes:
            set_dequant_rows(rows)
            name = f"chunk {chunks[0]}, dequant from {'off' if rows == OFF else rows} rows"
            result["split_ms"][name] = layer_split(engine, ids, chunks[0])
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
