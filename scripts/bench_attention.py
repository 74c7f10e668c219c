"""One-row attention over a long cache: the fused kernel against the ops form, decode side by side.

    python scripts/bench_attention.py [--model DIR] [--lengths 64,1024,2048,4000] [--tokens 48] [--runs 3]

For each prompt length (random ids), one warm-up request fills the prefix cache (the prefill is
paid once), then requests alternate between the two paths of `engine/models/layers.py` (every
one-row step in ops, or every one in `mx.fast.scaled_dot_product_attention`), seeded sampling at
temperature 1; prints decode tok/s medians, the median gap between tokens over all runs (steadier
than tok/s on a shared machine), their ratios, and whether the tokens are the same. For lengths
past the bundled model's 4096 use a copy of it whose config raises `max_position_embeddings`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import engine.models.layers as layers  # noqa: E402
from engine.config import EngineConfig, SamplingParams  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=BUNDLED / "target")
    ap.add_argument("--lengths", default="64,1024,2048,4000")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    lengths = [int(n) for n in a.lengths.split(",")]
    engine = Engine(EngineConfig(model_path=str(a.model), prefix_cache=True, max_context=max(lengths) + a.tokens + 1))
    sampling = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=1.0, seed=0)

    def decode(prompt: list[int], gaps: list[float]) -> tuple[float, list[int]]:
        out: list[int] = []
        last = None
        for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=sampling)):
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1e3 / max(1, len(step.token_ids)))
            last = now
            out += step.token_ids
            if step.stats is not None:
                tps = step.stats.decode_tps
        return tps, out

    threshold = layers.OPS_ATTENTION_FROM
    for n in lengths:
        prompt = [int(t) for t in np.random.RandomState(n).randint(0, engine.vocab_size, size=n)]
        t0 = time.perf_counter()
        decode(prompt, [])
        print(f"{n} tokens: prefill (warm-up) {time.perf_counter() - t0:.0f} s", flush=True)
        tps: dict[str, list[float]] = {"ops": [], "fused": []}
        gaps: dict[str, list[float]] = {"ops": [], "fused": []}
        tokens: dict[str, list[int]] = {}
        for _ in range(a.runs):
            for name, start in (("ops", 1), ("fused", 10**9)):
                layers.OPS_ATTENTION_FROM = start
                speed, tokens[name] = decode(prompt, gaps[name])
                tps[name].append(speed)
        layers.OPS_ATTENTION_FROM = threshold
        ops, fused = statistics.median(tps["ops"]), statistics.median(tps["fused"])
        gap_ops, gap_fused = statistics.median(gaps["ops"]), statistics.median(gaps["fused"])
        print(f"{n} tokens: ops {ops:.1f} tok/s, fused {fused:.1f} tok/s, ratio {ops / fused:.2f}; median gap "
              f"ops {gap_ops:.2f} ms, fused {gap_fused:.2f} ms, ratio {gap_fused / gap_ops:.2f}; "
              f"same tokens: {tokens['ops'] == tokens['fused']}", flush=True)


if __name__ == "__main__":
    main()
