"""The host's Python time a token in the tree-size controller, the drafter's bookkeeping and the
round loop, on text where guesses miss (temperature 1 after random ids), per method.

    python scripts/profile_controller.py [--methods ngram,mtp] [--tokens 96] [--runs 3] [--prompt-tokens 64]

On the dev CPU the host's Python shares the two cores with the round being computed, so every
microsecond it takes a plain round is time the round's compute does not get: where the controller
settles on plain rounds, this is what a drafter costs over plain decoding besides its tries. Each
function is wrapped with a wall-clock timer (the wrapper adds ~1 µs a call); nested calls are
counted in both (e.g. `best` inside `budget`). Prints µs a token and calls a token, the last run's.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import engine.round as rounds  # noqa: E402
from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.drafters.mtp import MTPDrafter  # noqa: E402
from engine.drafters.ngram import NgramDrafter  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.spec_control import SpecController  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402

SECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
TIMED = {SpecController: ("budget", "best", "gated", "record", "observe", "confide"),
         NgramDrafter: ("skip", "observe", "propose", "hindsight"),
         MTPDrafter: ("skip", "observe", "guess_after"),
         rounds.Rounds: ("can_pipeline", "land")}


def timed(owner: type, name: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)
    key = f"{owner.__name__}.{name}"

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[key] += time.perf_counter() - t0
            CALLS[key] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="ngram,mtp")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    a = ap.parse_args()
    for owner, names in TIMED.items():
        for name in names:
            timed(owner, name)
    engine = Engine(EngineConfig(model_path=str(BUNDLED / "target"), prefix_cache=False, dtype="float32"))
    prompt = [int(t) for t in np.random.RandomState(64).randint(0, engine.vocab_size, size=a.prompt_tokens)]
    sampling = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=1.0, seed=0)
    for method in a.methods.split(","):
        spec = SpecConfig(method=method, tree="ddtree")
        for _ in range(a.runs + 1):  # the first warms up
            SECONDS.clear()
            CALLS.clear()
            for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=sampling, spec=spec)):
                if step.stats is not None:
                    stats = step.stats
        print(f"{method}: {stats.decode_tps:.1f} tok/s, {stats.tokens_per_forward:.2f} tokens per forward")
        for key in sorted(SECONDS):
            us, calls = SECONDS[key] * 1e6 / a.tokens, CALLS[key] / a.tokens
            print(f"  {key:28} {us:7.1f} µs a token  {calls:5.2f} calls a token")


if __name__ == "__main__":
    main()
