"""Every round of one generation, in order: how long its launch took (drafting, graph building,
queueing), whether it was pipelined (queued before the previous round landed), its tree size and
the budget the controller gave it, and the gap since the previous landing (what a streaming client
waits). For finding where a tail of slow gaps comes from.

    python scripts/round_timeline.py [--method ngram] [--prompt-ids 64 | --text chat] [--tokens 96] [--temperature 1]
        [--model DIR] [--variant gh0]

Runs the bundled target on a prompt of random ids (seeded), or on bench_spec.py's prompt of a
kind (`--text`); the engine is called directly, one warm-up generation first. `--model` another
checkpoint (a long prompt needs one whose context fits it), `--variant` one of scripts/variants.py's
suffixes around both generations. Prints one line per launch and per landing, then the gaps'
median, p95 and max for rounds that were and were not pipelined.
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

import engine.round as rounds  # noqa: E402
from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402
from scripts.variants import variant_setting  # noqa: E402

EVENTS: list[tuple[str, int, int, float, float]] = []  # kind, tree size, budget/tokens, time, ms


def instrument() -> None:
    """Wrap Rounds' launch, launch_after and land to record each call."""
    launch, after, land = rounds.Rounds.launch, rounds.Rounds.launch_after, rounds.Rounds.land

    def timed_launch(self: rounds.Rounds, room: int) -> rounds.InFlight:
        t = time.perf_counter()
        f = launch(self, room)
        EVENTS.append(("launch", f.tree.size, f.arm, t, (time.perf_counter() - t) * 1e3))
        return f

    def timed_after(self: rounds.Rounds, flight: rounds.InFlight) -> rounds.InFlight:
        t = time.perf_counter()
        f = after(self, flight)
        EVENTS.append(("pipelined", f.tree.size, f.arm, t, (time.perf_counter() - t) * 1e3))
        return f

    def timed_land(self: rounds.Rounds, flight: rounds.InFlight) -> rounds.RoundResult:
        r = land(self, flight)
        EVENTS.append(("land", flight.tree.size, len(r.tokens), time.perf_counter(), flight.draft_ms))
        return r

    rounds.Rounds.launch, rounds.Rounds.launch_after, rounds.Rounds.land = timed_launch, timed_after, timed_land


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--tree", default=None, help="tree builder (ddtree, chain, ...)")
    ap.add_argument("--prompt-ids", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--text", default="", help="a prompt kind of bench_spec.py (e.g. chat) instead of random ids")
    ap.add_argument("--model", default=str(BUNDLED / "target"))
    ap.add_argument("--variant", default="", help="a suffix of scripts/variants.py, e.g. gh0")
    a = ap.parse_args()
    instrument()
    engine = Engine(EngineConfig(model_path=a.model, max_context=max(8192, a.prompt_ids + a.tokens + 1)))
    if a.text:
        from scripts.bench_spec import PROMPTS, render

        prompt = render(engine, PROMPTS[a.text][0])
    else:
        prompt = [int(t) for t in np.random.RandomState(0).randint(0, 8000, size=a.prompt_ids)]
    params = SamplingParams(max_tokens=a.tokens, temperature=a.temperature, seed=a.seed)
    spec = SpecConfig(method=a.method, **({"tree": a.tree} if a.tree else {}))
    for _ in range(2):  # a warm-up generation, then the one printed
        EVENTS.clear()
        with variant_setting(f"x-{a.variant}" if a.variant else "x"):
            list(engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params, spec=spec)))
    previous = None
    queued_ahead = False  # the round landing next was queued before the previous landing
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for kind, size, n, t, ms in EVENTS:
        if kind == "land":
            gap = (t - previous) * 1e3 if previous is not None else float("nan")
            if previous is not None:
                gaps[queued_ahead].append(gap)
            previous = t
            print(f"land      size {size:2d}  tokens {n}  gap {gap:6.1f} ms  (drafting {ms:.1f} ms)")
            queued_ahead = False
        else:
            queued_ahead = queued_ahead or kind == "pipelined"
            print(f"  {kind:9s} size {size:2d}  budget {n:2d}  took {ms:5.1f} ms")
    for pipelined, g in gaps.items():
        if g:
            g = sorted(g)
            print(f"{'pipelined' if pipelined else 'not pipelined'}: {len(g)} gaps, median {statistics.median(g):.1f}"
                  f" ms, p95 {g[int(0.95 * (len(g) - 1))]:.1f}, max {g[-1]:.1f}")


if __name__ == "__main__":
    main()
