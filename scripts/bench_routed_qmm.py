"""A quantized checkpoint with its projections on the engine's matmul (engine/models/qlinear.py:
dequantize + GEMM from a few rows on the CPU, qmm_mma on CUDA) against MLX's quantized matmul,
side by side in one process, runs interleaved.

    python scripts/bench_routed_qmm.py --model DIR [--prompt-tokens 1024] [--tokens 64] [--runs 3]

Per engine, medians of the runs, the engine's own timings: prefill tok/s of a prompt of random
ids, plain decode tok/s, and decode tok/s with prompt lookup at a fixed budget of 16 (17-row
verifies) on a prompt that repeats a motif (so that guesses hit: the rows are what is measured),
with its tokens per forward and the distinct-8-gram share of its output (low: the text loops,
which is what makes the guesses hit here); and whether the greedy outputs agree between the engines and between
plain and speculative decoding. Make a 4-bit checkpoint with `spruce convert SRC DIR --bits 4`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import numpy as np  # noqa: E402
from bench_spec import distinct_8grams  # noqa: E402

from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import Engine  # noqa: E402
from engine.types import GenerationRequest, Stats  # noqa: E402


def run(engine: Engine, prompt: list[int], tokens: int, spec: SpecConfig | None = None) -> tuple[list[int], Stats]:
    req = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(max_tokens=tokens, ignore_eos=True), spec=spec)
    out, stats = [], Stats()
    for step in engine.generate(req):
        out += step.token_ids
        stats = step.stats or stats
    return out, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    engines = {}
    for label, switch in (("engine's matmul", "1"), ("MLX quantized_matmul", "0")):
        os.environ["SPRUCE_QMM"] = switch  # read by the loader
        engines[label] = Engine(EngineConfig(model_path=a.model, prefix_cache=False))
    os.environ.pop("SPRUCE_QMM")
    rng = np.random.RandomState(0)
    vocab = min(8000, engines[next(iter(engines))].vocab_size)
    long_prompt = [int(t) for t in rng.randint(100, vocab, size=a.prompt_tokens)]
    looping = [int(t) for t in rng.randint(100, vocab, size=24)] * 6
    lookup = SpecConfig(method="ngram", budget=16, max_depth=8, adaptive=False)
    figures: dict[str, dict[str, list[float]]] = {k: {} for k in engines}
    texts: dict[str, list[tuple[list[int], list[int]]]] = {k: [] for k in engines}
    for _ in range(a.runs):
        for label, engine in engines.items():
            f = figures[label]
            f.setdefault("prefill tok/s", []).append(run(engine, long_prompt, 1)[1].prefill_tps)
            plain, s_plain = run(engine, looping, a.tokens)
            fast, s_fast = run(engine, looping, a.tokens, lookup)
            f.setdefault("plain decode tok/s", []).append(s_plain.decode_tps)
            f.setdefault("ngram@16 decode tok/s", []).append(s_fast.decode_tps)
            f.setdefault("ngram tok/fwd", []).append(s_fast.tokens_per_forward)
            f.setdefault("distinct 8-grams", []).append(distinct_8grams(fast))
            texts[label].append((plain, fast))
    names = list(figures[next(iter(figures))])
    print("| engine | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, f in figures.items():
        print(f"| {label} | " + " | ".join(f"{statistics.median(f[n]):.2f}" for n in names) + " |")
    pairs = [p for v in texts.values() for p in v]
    first = [v[0] for v in texts.values()]
    print(f"plain == ngram in every run: {all(p == q for p, q in pairs)}; "
          f"engines agree (plain, ngram): {first[0][0] == first[1][0]}, {first[0][1] == first[1][1]}")


if __name__ == "__main__":
    main()
