"""Where speculation's time goes where guesses miss: each tree size the controller
(engine/spec_control.py) chose, how many rounds of it a request ran, the tokens a round emitted and
its median time, beside plain decoding's rounds, on the bundled target.

    python scripts/controller_arms.py [--length 64] [--tokens 96] [--runs 6] [--methods ngram,mtp,dflash,draft]
        [--against REV]

Seeded sampling (temperature 1) after a prompt of random ids, as in scripts/bench_controller.py's
misses; every method is run after plain decoding in each repetition (one warm-up first). Per method:
the decode tok/s ratio to the plain run beside it (median), and per arm (budget; -1: a round whose
budget the room left cut) the rounds a run, tokens a round, the median round in ms and the ms a run
spent in that arm. A plain round of speculation costs what a plain round of plain decoding does
only if the drafter's bookkeeping is free; the arms above 0 are the tries, and what they cost
beyond the tokens they emit is the loss against plain decoding. With --against, the controller
(engine/spec_control.py and engine/round.py) at git revision REV runs beside the working tree's,
interleaved in the same process: the arms each chose are less noisy than the two tok/s ratios.
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

from bench_controller import METHODS, controller_at  # noqa: E402

import engine.generate as generation  # noqa: E402
import engine.round as current  # noqa: E402
from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest, Stats  # noqa: E402

Record = tuple[int, int, float]  # (budget, tokens, ms) of one round


class ArmLog:
    """Every record call of the given controller classes while installed (their own inputs)."""

    def __init__(self) -> None:
        self.rounds: list[Record] = []

    def install(self, controller_class: type) -> None:
        log, record = self.rounds, controller_class.record

        def logged(controller: object, budget: int, tokens: int, ms: float) -> None:
            log.append((budget, tokens, ms))
            record(controller, budget, tokens, ms)

        controller_class.record = logged  # type: ignore[attr-defined]


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
    ap.add_argument("--against", help="git revision of a second controller, run beside the working tree's")
    a = ap.parse_args()
    methods = [m for m in a.methods.split(",") if m]
    if not methods or any(m not in METHODS for m in methods):
        ap.error(f"--methods takes some of {', '.join(METHODS)}, got {a.methods!r}")
    rounds_modules = {"now": current}
    if a.against:
        rounds_modules[a.against] = controller_at(a.against)
    engine = Engine(EngineConfig(model_path=str(BUNDLED / "target"), prefix_cache=False,
                                 max_context=max(a.length + a.tokens + 1, EngineConfig.max_context)))
    prompt = [int(t) for t in np.random.RandomState(a.length).randint(0, engine.vocab_size, size=a.length)]
    params = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=1.0, seed=0)
    log = ArmLog()
    for module in rounds_modules.values():
        log.install(module.SpecController)
    plain: list[Stats] = []
    keys = [m if len(rounds_modules) == 1 else f"{m}:{c}" for m in methods for c in rounds_modules]
    results: dict[str, list[tuple[Stats, list[Record]]]] = {k: [] for k in keys}
    for r in range(a.runs + 1):  # the first repetition warms up
        stats = run(engine, prompt, params, SpecConfig())
        if r:
            plain.append(stats)
        for m in methods:
            for c, module in rounds_modules.items():
                generation.Rounds = module.Rounds  # type: ignore[attr-defined]
                log.rounds.clear()
                stats = run(engine, prompt, params, METHODS[m])
                if r:
                    results[m if len(rounds_modules) == 1 else f"{m}:{c}"].append((stats, list(log.rounds)))
        generation.Rounds = current.Rounds
    ms = statistics.median(s.verify_ms / s.forward_passes for s in plain)
    print(f"{a.length} random ids, {a.tokens} tokens sampled, {a.runs} runs; plain decoding: "
          f"{statistics.median(s.decode_tps for s in plain):.1f} tok/s, {ms:.1f} ms a round (its wait, median)")
    for m, rows in results.items():
        ratio = statistics.median(s.decode_tps / p.decode_tps for (s, _), p in zip(rows, plain, strict=True))
        tpf = statistics.median(s.tokens_per_forward for s, _ in rows)
        print(f"- {m}: {ratio:.3f}x plain, {tpf:.2f} tokens per forward; arms: {arms([r for _, r in rows])}")


if __name__ == "__main__":
    main()
