"""The Python a plain round spends on the n-gram drafter and its tree-size controller.

    python scripts/bench_bookkeeping.py [--lengths 64,4000] [--tokens 300] [--replays 7]

Where guesses miss, the controller runs plain rounds, and what such a round costs beyond plain
decoding's is mostly this host work: the controller's queries for the round's budget, the drafter's
`skip` (its index and the tree it watches), the controller's record and the drafter's hindsight. On
a two-core CPU it competes with the round's compute (issue 17, item 2). The bundled target first
samples `--tokens` tokens (temperature 1, seed 0) after a prompt of random ids of each length; the
bookkeeping of those rounds is then replayed without the model, `--replays` times, and the median
microseconds a round are printed. Deterministic work, so it is comparable from one commit to the
next where end-to-end ratios of a few percent are lost in the machine's noise.
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

from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.drafters.ngram import NgramDrafter  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.spec_control import RoundCosts  # noqa: E402
from engine.spec_evidence import ByEvidence  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402

BUDGET, MAX_DEPTH = 16, 8  # SpecConfig's defaults


def replay(prompt: list[int], out: list[int]) -> float:
    """Microseconds a round of the bookkeeping of plain rounds that emitted `out`, as engine/round.py
    does it: two budget queries (the launch's and the pipelining check's), the drafter's evidence,
    its skip, the controller's record and the hindsight handed to it."""
    drafter = NgramDrafter()
    controller = ByEvidence(drafter, BUDGET, None, None, RoundCosts(), hindsight=True)  # as engine/round.py makes it
    drafter.begin(prompt)
    drafter.watch([a.budget for a in controller.arms[1:]], MAX_DEPTH)
    for c in controller.controllers:  # every arm measured once, so that hindsight is counted
        for arm in c.arms:
            c.record(arm.budget, 1, 1.3 * (1 + arm.budget / 8), arm.budget + 1)
    t = time.perf_counter()
    for token in out:
        c = controller.at(controller.now())
        c.fitting(1 << 20)
        c.fitting(1 << 20)
        drafter.skip(drafter.ctx[-1], [token])
        c.record(0, 1, 1.3, 1)
        controller.observe(drafter.hindsight())
    return (time.perf_counter() - t) / len(out) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,4000")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--replays", type=int, default=7)
    a = ap.parse_args()
    lengths = [int(n) for n in a.lengths.split(",")]
    engine = Engine(EngineConfig(model_path=str(BUNDLED / "target"), prefix_cache=False, dtype="float32",
                                 max_context=max(lengths) + a.tokens + 1))
    sampling = SamplingParams(temperature=1.0, seed=0, max_tokens=a.tokens, ignore_eos=True)
    print(f"n-gram drafter and controller, plain rounds after random ids, {a.tokens} tokens sampled, "
          f"median of {a.replays} replays")
    for n in lengths:
        for r in (1, 2):
            prompt = [int(t) for t in np.random.RandomState(r * 1000 + n).randint(0, engine.vocab_size, size=n)]
            req = GenerationRequest(prompt_ids=prompt, sampling=sampling, spec=SpecConfig())
            out = [t for step in engine.generate(req) for t in step.token_ids]
            us = statistics.median(replay(prompt, out) for _ in range(a.replays))
            print(f"prompt {n} tokens (seed {r * 1000 + n}): {us:.1f} us a round")


if __name__ == "__main__":
    main()
