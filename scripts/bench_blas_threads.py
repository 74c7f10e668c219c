"""OpenBLAS's threads paced by the engine (engine/blas.py `pace`) against all threads always, in one
process, paired run by run on the CPU.

    python scripts/bench_blas_threads.py [--runs 6] [--tokens 96] [--model DIR] [--cases plain64,mtp64,...]

The engine sets OpenBLAS to all threads but one while the host builds the next round (pipelined
one-node rounds) and to all of them for what the host waits for (trees, drafting, prefill). This
switches the pacing off and on between runs of the same request (the order alternating), on the
bundled target, fp32: plain decoding after 64 and 4000 random ids and MTP after 64 (temperature 1,
seeded: guesses miss), MTP with fixed 16-node trees and with the controller on a code prompt
(greedy: guesses hit). Prints decode tok/s medians and the median of the paired ratios, and
whether the outputs were identical (a product's rounding may move with the thread count, so a
near-tie may flip: BENCHMARKS.md, issue 17, twenty-second session).
Needs OpenBLAS preloaded (the script re-execs itself with it) and no OPENBLAS_NUM_THREADS set.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from bench_spec import PROMPTS, render  # noqa: E402

from engine import blas  # noqa: E402
from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402

CASES = {  # key: (what it is; prompt: random ids of this length, or 0 = a code prompt; spec; temperature)
    "plain64": ("plain, 64 random ids", 64, SpecConfig(), 1.0),
    "plain4000": ("plain, 4000 random ids", 4000, SpecConfig(), 1.0),
    "mtp64": ("mtp, 64 random ids", 64, SpecConfig(method="mtp", tree="ddtree"), 1.0),
    "plain2048": ("plain, 2048 random ids", 2048, SpecConfig(), 1.0),
    "mtp2048": ("mtp, 2048 random ids", 2048, SpecConfig(method="mtp", tree="ddtree"), 1.0),
    "mtp16code": ("mtp 16-node trees, code", 0, SpecConfig(method="mtp", tree="ddtree", adaptive=False), 0.0),
    "mtpcode": ("mtp, code", 0, SpecConfig(method="mtp", tree="ddtree"), 0.0),
}


def run(engine: Engine, prompt: list[int], spec: SpecConfig, sampling: SamplingParams) -> tuple[float, list[int]]:
    tokens: list[int] = []
    for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=sampling, spec=spec)):
        tokens += step.token_ids
        if step.stats is not None:
            stats = step.stats
    return stats.decode_tps, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--model", default=str(BUNDLED / "target"), help="target checkpoint (default: the bundled one)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    a = ap.parse_args()
    cases = {k: CASES[k] for k in a.cases.split(",") if k}
    engine = Engine(EngineConfig(model_path=a.model, prefix_cache=False, dtype="float32"))
    default = blas.ADAPT_THREADS
    lib = blas._openblas()
    if lib is None:
        raise SystemExit("no OpenBLAS whose threads can be set in this process (OPENBLAS_NUM_THREADS set?)")
    every = blas._THREADS["all"]
    print(f"OpenBLAS with {every} threads; {a.tokens} tokens; medians of {a.runs} paired runs")

    def pacing(on: bool) -> None:
        blas.ADAPT_THREADS = on
        if not on:
            lib.openblas_set_num_threads(every)
            blas._THREADS["now"] = every

    code = render(engine, PROMPTS["code"][1])
    tps: dict[tuple[str, bool], list[float]] = {(c, on): [] for c in cases for on in (True, False)}
    identical = True
    for r in range(a.runs + 1):  # the first repetition warms up (compiles) and is dropped
        for name, (_, length, spec, temperature) in cases.items():
            prompt = code if not length else [
                int(t) for t in np.random.RandomState(r * 7 + length).randint(0, engine.vocab_size, size=length)]
            sampling = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=temperature, seed=r)
            outputs = []
            for on in ((True, False) if r % 2 else (False, True)):
                pacing(on)
                speed, tokens = run(engine, prompt, spec, sampling)
                outputs.append(tokens)
                if r:
                    tps[(name, on)].append(speed)
            identical = identical and outputs[0] == outputs[1]
    blas.ADAPT_THREADS = default
    print("| request | paced tok/s | all threads tok/s | paired ratio (median) | ratios |")
    print("|---|---|---|---|---|")
    for name, (what, *_) in cases.items():
        paced, fixed = tps[(name, True)], tps[(name, False)]
        ratios = [p / f for p, f in zip(paced, fixed, strict=True)]
        print(f"| {what} | {statistics.median(paced):.1f} | {statistics.median(fixed):.1f} | "
              f"{statistics.median(ratios):.3f}x | {', '.join(f'{x:.2f}' for x in ratios)} |")
    print(f"outputs identical, paced and not: {identical}")


if __name__ == "__main__":
    main()
