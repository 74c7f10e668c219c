"""What the warm-up of `spruce serve` (engine/warmup.py) moves out of the first requests.

    python scripts/bench_warmup.py --model DIR [--budget 16] [--depth 8] [--tokens 16]

Each setup runs in a fresh process (MLX compiles kernels once per process): load the engine, warm
it up or not, then time the first request (128 random ids, greedy, --tokens new tokens, prefix
cache off) and the first verify of draft trees of several sizes on a fresh cache. Prints seconds
to load, to warm up, and the first-use times with and without the warm-up.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

SIZES = (2, 5, 9, 16, 17, 25, 33)


def child(a: argparse.Namespace) -> dict:
    import mlx.core as mx
    import numpy as np

    from engine import forward
    from engine.config import EngineConfig, SamplingParams, SpecConfig
    from engine.generate import Engine
    from engine.types import GenerationRequest
    from engine.warmup import chain_with_siblings, warm_up

    out: dict = {"warmup": a.child}
    t0 = time.perf_counter()
    spec = SpecConfig(method="ngram", budget=a.budget, max_depth=a.depth)
    engine = Engine(EngineConfig(model_path=a.model, prefix_cache=False, spec=spec))
    out["load_s"] = time.perf_counter() - t0
    if a.child == "on":
        out["warmup_s"] = warm_up(engine).seconds
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, min(engine.vocab_size, 8000), size=128)]
    req = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(max_tokens=a.tokens, ignore_eos=True))
    t0 = time.perf_counter()
    first = None
    for step in engine.generate(req):
        if first is None and step.token_ids:
            first = time.perf_counter() - t0
    out["first_request_ttft_s"] = first
    out["first_request_s"] = time.perf_counter() - t0
    cache = engine.make_cache()
    forward.extend(engine.model, cache, prompt[:-1], engine.prefill_chunk)
    out["first_verify_ms"] = {}
    for n in (s for s in SIZES if s <= a.budget + 1):
        marks = [c.mark() for c in cache]
        tree = chain_with_siblings(prompt[-1], n, min(a.depth, n - 1), engine.vocab_size)
        t0 = time.perf_counter()
        mx.eval(forward.verify(engine.model, cache, tree, len(prompt) - 1))
        forward.commit(cache, tree.path_to(min(a.depth, n - 1)))
        out["first_verify_ms"][str(n)] = (time.perf_counter() - t0) * 1e3
        for c, m in zip(cache, marks, strict=True):
            c.rewind(m)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    rows = []
    for mode in ("off", "on"):
        p = subprocess.run([sys.executable, __file__, "--model", a.model, "--budget", str(a.budget), "--depth",
                            str(a.depth), "--tokens", str(a.tokens), "--child", mode], capture_output=True, text=True)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(p.stdout, p.stderr, sep="\n")
            raise SystemExit(f"the {mode} run failed")
        rows.append(json.loads(line[len("RESULT "):]))
        print(json.dumps(rows[-1]), flush=True)
    sizes = list(rows[0]["first_verify_ms"])
    print("\n| warm-up | load s | warm-up s | first request: TTFT s / total s | first verify ms, N = "
          + " / ".join(sizes) + " |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['warmup']} | {r['load_s']:.1f} | {r.get('warmup_s', 0):.1f} | {r['first_request_ttft_s']:.2f} / "
              f"{r['first_request_s']:.2f} | " + " / ".join(f"{r['first_verify_ms'][s]:.0f}" for s in sizes) + " |")


if __name__ == "__main__":
    main()
