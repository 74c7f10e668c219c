"""What a plain round costs with a drafter on, against plain decoding's own rounds.

    python scripts/profile_plain_rounds.py [--methods mtp,ngram] [--probes engine,nc] [--runs 5]
        [--tokens 96] [--length 64] [--model DIR --dflash-model DIR] [--dtype float32] [--trace]

Where guesses miss, the tree-size controller (engine/spec_control.py) settles on plain rounds, and
then speculation runs at the speed of its plain rounds: issue 17's 0.95x of plain decoding is
bounded by how much slower those are than plain decoding's. Replayed over the H200 recording
(scripts/controller_sim.py), MTP's plain rounds took 7.74 ms against plain decoding's 7.15, and the
controller could not do better than ~0.92x there whatever it chose. This script times them: one
request where guesses miss (seeded sampling at temperature 1 after `--length` random ids, as
scripts/bench_context.py's), with plain decoding and with each method under the controller, in one
process, interleaved run by run after a warm-up; every round's time as the controller is handed it
(engine/round.py), and the median of the one-node rounds that followed a one-node round (the
pipelined ones). Probes, interleaved too:

- `engine`: the engine as it is;
- `nc`: the target's confidence not read (engine/round.py `Rounds.confides` off: no top-token
  probability in the round's graph, no gate);
- `pl`: the controller's plain rounds with the drafter's state kept (no propose, skip) but no
  controller call at all between rounds (the budget fixed at 0): what the controller's Python costs.

Prints per method and probe: the median pipelined plain round (ms) and its ratio to plain
decoding's in the same runs, tree rounds a request, and decode tok/s as a ratio to plain decoding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import numpy as np  # noqa: E402

import engine.round as rounds_module  # noqa: E402
from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402

METHODS = {"mtp": SpecConfig(method="mtp", tree="ddtree"), "mtp-chain": SpecConfig(method="mtp", tree="chain"),
           "ngram": SpecConfig(method="ngram"), "dflash": SpecConfig(method="dflash", tree="ddtree"),
           "draft": SpecConfig(method="draft")}
PROBES = ("engine", "nc", "pl")


class _Plain:
    """A controller that always answers 0 (probe `pl`): the calls engine/round.py makes of one."""

    def fitting(self, limit: int) -> int:
        return 0

    def record(self, *args: object) -> None:
        pass

    def confide(self, probabilities: object) -> None:
        pass

    def observe(self, seen: object) -> None:
        pass


def timed(engine: Engine, prompt: list[int], params: SamplingParams, spec: SpecConfig,
          probe: str) -> tuple[list[tuple[int, float, int]], float, int]:
    """One request: (tree size, ms, tokens) of every round, the decode seconds (first token to last), tokens."""
    out: list[tuple[int, float, int]] = []
    count, init = rounds_module.Rounds._count, rounds_module.Rounds.__init__

    def counted(self, flight, accepted, emitted, t2, t3) -> None:  # noqa: ANN001
        count(self, flight, accepted, emitted, t2, t3)
        out.append((flight.tree.size, self.last_round_ms, emitted))

    def made(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        init(self, *args, **kwargs)
        if probe == "nc":
            self.confides = False
        elif probe == "pl" and self.controller is not None:
            self.controller, self.confides = _Plain(), False

    rounds_module.Rounds._count, rounds_module.Rounds.__init__ = counted, made  # type: ignore[method-assign]
    first = last = 0.0
    tokens = 0
    try:
        for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params, spec=spec)):
            last = time.perf_counter()
            first = first or last
            tokens += len(step.token_ids)
    finally:
        rounds_module.Rounds._count, rounds_module.Rounds.__init__ = count, init  # type: ignore[method-assign]
    return out, last - first, tokens


def pipelined(rounds: list[tuple[int, float, int]]) -> list[float]:
    """The one-node rounds that followed a one-node round."""
    return [ms for (size, ms, _), (before, _, _) in zip(rounds[1:], rounds) if size == 1 and before == 1]


def trace(last: dict[tuple[str, str], list[tuple[int, float, int]]]) -> str:
    """Each method and probe's last run: every tree round (its index, nodes, ms, tokens) and the
    round after it, and what they took beyond the plain rounds that would have emitted their tokens
    (the trees' share of the loss where guesses miss)."""
    lines = ["last run's tree rounds: #index nodes ms tokens, then the round after (nodes ms)"]
    for (method, probe), rounds in last.items():
        if method == "none":
            continue
        plain = statistics.median(pipelined(rounds) or [0.0])
        parts, extra = [], 0.0
        for i, (size, ms, emitted) in enumerate(rounds):
            if size > 1:
                after = rounds[i + 1] if i + 1 < len(rounds) else None
                parts.append(f"#{i} {size} {ms:.2f} {emitted}" + (f" -> {after[0]} {after[1]:.2f}" if after else ""))
                extra += ms - emitted * plain + ((after[1] - plain) if after and after[0] == 1 else 0.0)
        total = sum(ms for _, ms, _ in rounds)
        lines.append(f"{method} {probe}: plain {plain:.2f} ms, trees + the rounds after them {extra:.1f} ms "
                     f"beyond plain rounds' ({100 * extra / total:.1f} % of {total:.0f} ms): " + "; ".join(parts))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="mtp,ngram", help=f"of {', '.join(METHODS)}")
    ap.add_argument("--probes", default="engine,nc,pl", help=f"of {', '.join(PROBES)}")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--length", type=int, default=64, help="random-id prompt tokens")
    ap.add_argument("--model", default=str(BUNDLED / "target"))
    ap.add_argument("--dflash-model", default=None)
    ap.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    ap.add_argument("--trace", action="store_true",
                    help="print the last run's tree rounds and the round after each, per method and probe")
    a = ap.parse_args()
    methods = [m for m in a.methods.split(",") if m]
    probes = [p for p in a.probes.split(",") if p]
    if any(m not in METHODS for m in methods) or any(p not in PROBES for p in probes):
        ap.error(f"--methods takes some of {', '.join(METHODS)}, --probes some of {', '.join(PROBES)}")
    config = EngineConfig(model_path=a.model, prefix_cache=False, spec=SpecConfig(dflash_model=a.dflash_model))
    if a.dtype:
        config = replace(config, dtype=a.dtype)
    engine = Engine(config)
    prompt = [int(t) for t in np.random.RandomState(a.length).randint(0, engine.vocab_size, size=a.length)]
    params = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=1.0, seed=0)
    cells = [("none", "engine")] + [(m, p) for m in methods for p in probes]
    got: dict[tuple[str, str], list[tuple[float, int, float]]] = {c: [] for c in cells}
    last: dict[tuple[str, str], list[tuple[int, float, int]]] = {}
    for r in range(a.runs + 1):  # the first is the warm-up
        for method, probe in cells:
            spec = SpecConfig() if method == "none" else replace(METHODS[method], dflash_model=a.dflash_model)
            rounds, seconds, tokens = timed(engine, prompt, params, spec, probe)
            if r:
                got[(method, probe)].append((statistics.median(pipelined(rounds)),
                                             sum(size > 1 for size, _, _ in rounds), tokens / seconds))
                last[(method, probe)] = rounds
    if a.trace:
        print(trace(last))
    base = got[("none", "engine")]
    print(f"{a.runs} runs, {a.tokens} tokens after {a.length} random ids, seeded sampling at temperature 1")
    print("| method | probe | pipelined plain round, ms (median of runs) | vs plain decoding's | trees a request | "
          "decode tok/s vs plain |")
    print("|---|---|---|---|---|---|")
    for method, probe in cells:
        runs = got[(method, probe)]
        ms = statistics.median(x[0] for x in runs)
        vs = statistics.median(x[0] / b[0] for x, b in zip(runs, base))
        speed = statistics.median(x[2] / b[2] for x, b in zip(runs, base))
        trees = statistics.mean(x[1] for x in runs)
        print(f"| {method} | {probe} | {ms:.3f} | {vs:.3f} | {trees:.1f} | {speed:.3f} |")


if __name__ == "__main__":
    main()
