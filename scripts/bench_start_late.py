"""The late start of pipelined rounds on the CPU (engine.round.START_LATE_ON_CPU) on and off, in
one process, alternating with plain decoding: decode tok/s (each repetition's against plain
decoding's of the same repetition) and pooled inter-token gaps (p50 / p99 / max), on text sampled
at temperature 1 after random ids (guesses miss), with the distinct 8-gram share of the output.

    python scripts/bench_start_late.py [--method mtp|ngram|none] [--reps 7] [--tokens 96]
    python scripts/bench_start_late.py --method mtp --ahead-layers 0,2 --reps 30

The second form compares settings of engine.round.START_AHEAD_LAYERS (late start on) with plain
decoding, each repetition's tok/s divided by plain decoding's of the same repetition.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from bench_context import distinct_8grams  # noqa: E402

import engine.round as rounds  # noqa: E402
from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="mtp")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--ahead-layers", default="",
                    help="instead of late start on / off: late start with each of these settings of "
                         "engine.round.START_AHEAD_LAYERS (e.g. 0,2), and plain decoding as the reference")
    a = ap.parse_args()
    engine = Engine(EngineConfig(model_path=str(BUNDLED / "target"), prefix_cache=False))
    prompt = [int(t) for t in np.random.RandomState(64).randint(0, 8000, size=64)]
    params = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=1.0, seed=0)
    spec = SpecConfig(method=a.method, tree="ddtree") if a.method != "none" else SpecConfig()
    # (label, spec, START_LATE_ON_CPU, START_AHEAD_LAYERS)
    if a.ahead_layers:
        setups = [("plain decoding", SpecConfig(), True, 0)] + [
            (f"{a.method}, {n} layers ahead", spec, True, n) for n in map(int, a.ahead_layers.split(","))]
    else:
        setups = [("plain decoding", SpecConfig(), True, rounds.START_AHEAD_LAYERS)] + [
            (f"{a.method}, late start {'on ' if late else 'off'}", spec, late, rounds.START_AHEAD_LAYERS)
            for late in (True, False)]
    tps: dict[str, list[float]] = {s[0]: [] for s in setups}
    tpf: dict[str, list[float]] = {s[0]: [] for s in setups}  # tokens per forward pass
    gaps: dict[str, list[float]] = {s[0]: [] for s in setups}
    grams: list[float] = []
    for rep in range(a.reps + 1):  # the first of each is a warm-up
        for label, run_spec, late, ahead in setups:
            rounds.START_LATE_ON_CPU, rounds.START_AHEAD_LAYERS = late, ahead
            last, out, g = None, [], []
            for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params, spec=run_spec)):
                now = time.perf_counter()
                if step.token_ids and last is not None:  # a batch of n tokens: n gaps of gap / n
                    g += [(now - last) * 1e3 / len(step.token_ids)] * len(step.token_ids)
                if step.token_ids:
                    last = now
                out += step.token_ids
                if step.stats is not None:
                    stats = step.stats
            if rep:
                tps[label].append(stats.decode_tps)
                tpf[label].append(stats.tokens_per_forward)
                gaps[label] += g
                grams.append(distinct_8grams(out))
    print(f"{a.method}, distinct 8-grams {statistics.median(grams):.2f}")
    ref = setups[0][0]
    for label, *_ in setups:
        g = sorted(gaps[label])
        paired = statistics.median(t / r for t, r in zip(tps[label], tps[ref]))  # each rep against its own reference
        print(f"{label}: {statistics.median(tps[label]):.1f} tok/s ({paired:.3f}x {ref}, paired by rep), "
              f"{statistics.median(tpf[label]):.2f} tokens per forward, gaps "
              f"p50 {g[len(g) // 2]:.1f} / p99 {g[int(0.99 * (len(g) - 1))]:.1f} / max {g[-1]:.1f} ms")


if __name__ == "__main__":
    main()
