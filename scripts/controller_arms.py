"""Where speculation's time goes where guesses miss: each tree size the controller
(engine/spec_control.py) chose, how many rounds of it a request ran, the tokens a round emitted and
its median time, beside plain decoding's rounds, on the bundled target.

    python scripts/controller_arms.py [--length 64] [--tokens 96] [--runs 6] [--methods ngram,mtp,dflash,draft]

Seeded sampling (temperature 1) after a prompt of random ids, as in scripts/bench_controller.py's
misses; every method is run after plain decoding in each repetition (one warm-up first). Per method:
the decode tok/s ratio to the plain run beside it (median), and per arm (budget; -1: a round whose
budget the room left cut) the rounds a run, tokens a round, the median round in ms and the ms a run
spent in that arm. A plain round of speculation costs what a plain round of plain decoding does
only if the drafter's bookkeeping is free; the arms above 0 are the tries, and what they cost
beyond the tokens they emit is the loss against plain decoding.
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

from bench_controller import METHODS  # noqa: E402

import engine.spec_control as spec_control  # noqa: E402
from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest, Stats  # noqa: E402

Record = tuple[int, int, float]  # (budget, tokens, ms) of one round


class ArmLog:
    """Every SpecController.record call while installed (the controller's own inputs)."""

    def __init__(self) -> None:
        self.rounds: list[Record] = []
        self._record = spec_control.SpecController.record

    def install(self) -> None:
        log, record = self.rounds, self._record

        def logged(controller: spec_control.SpecController, budget: int, tokens: int, ms: float) -> None:
            log.append((budget, tokens, ms))
            record(controller, budget, tokens, ms)

        spec_control.SpecController.record = logged  # type: ignore[method-assign]


def run(engine: Engine, prompt: list[int], params: SamplingParams, spec: SpecConfig) -> Stats:
    stats = None
    for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params, spec=spec)):
        if step.stats is not None:
            stats = step.stats
    assert stats is not None
    return stats


def arms(rounds: list[list[Record]]) -> str:
    by: dict[int, list[tuple[int, float]]] = {}
    for run_rounds in rounds:
        for budget, tokens, ms in run_rounds:
            by.setdefault(budget, []).append((tokens, ms))
    n = len(rounds)
    return "; ".join(f"{b}: {len(v) / n:.1f} rounds, {statistics.mean(t for t, _ in v):.2f} tok, "
                     f"{statistics.median(ms for _, ms in v):.1f} ms, {sum(ms for _, ms in v) / n:.0f} ms a run"
                     for b, v in sorted(by.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=64, help="random prompt ids")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--methods", default="ngram,mtp,dflash,draft", help=f"of {', '.join(METHODS)}")
    a = ap.parse_args()
    methods = [m for m in a.methods.split(",") if m]
    if not methods or any(m not in METHODS for m in methods):
        ap.error(f"--methods takes some of {', '.join(METHODS)}, got {a.methods!r}")
    engine = Engine(EngineConfig(model_path=str(BUNDLED / "target"), prefix_cache=False,
                                 max_context=max(a.length + a.tokens + 1, EngineConfig.max_context)))
    prompt = [int(t) for t in np.random.RandomState(a.length).randint(0, engine.vocab_size, size=a.length)]
    params = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=1.0, seed=0)
    log = ArmLog()
    log.install()
    plain: list[Stats] = []
    results: dict[str, list[tuple[Stats, list[Record]]]] = {m: [] for m in methods}
    for r in range(a.runs + 1):  # the first repetition warms up
        stats = run(engine, prompt, params, SpecConfig())
        if r:
            plain.append(stats)
        for m in methods:
            log.rounds.clear()
            stats = run(engine, prompt, params, METHODS[m])
            if r:
                results[m].append((stats, list(log.rounds)))
    ms = statistics.median(s.verify_ms / s.forward_passes for s in plain)
    print(f"{a.length} random ids, {a.tokens} tokens sampled, {a.runs} runs; plain decoding: "
          f"{statistics.median(s.decode_tps for s in plain):.1f} tok/s, {ms:.1f} ms a round (its wait, median)")
    for m, rows in results.items():
        ratio = statistics.median(s.decode_tps / p.decode_tps for (s, _), p in zip(rows, plain, strict=True))
        tpf = statistics.median(s.tokens_per_forward for s, _ in rows)
        print(f"- {m}: {ratio:.3f}x plain, {tpf:.2f} tokens per forward; arms: {arms([r for _, r in rows])}")


if __name__ == "__main__":
    main()
