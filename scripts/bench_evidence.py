"""The n-gram drafter's evidence (engine/spec_evidence.py): how well its guesses do by the length
of the match they come from, and the controller per evidence class against one controller.

    python scripts/bench_evidence.py orders [--kinds long,code,chat,math] [--tokens 128]
    python scripts/bench_evidence.py ab [--kinds long,code,chat,math] [--tokens 96] [--runs 3]
    python scripts/bench_evidence.py trace [--kinds long] [--tokens 96] [--runs 2]

- `orders`: plain decoding's greedy output for each bench_spec.py prompt; at every position, the
  n-gram drafter's top continuation (the longest match, its most recent occurrence) against the
  tokens that came: by the match's length, the positions, the mean accepted tokens (up to 8) and
  the share of positions where the first guess was right.
- `ab`: plain decoding, the n-gram drafter with one controller (`one`), and with one controller
  per evidence class (`classes`, the engine's way), interleaved, greedy, the bundled target: tok/s
  against plain decoding's run on the same prompt (median over runs), tokens per forward, the
  pooled p99 inter-token gap against plain decoding's (a round's gap spread over its tokens, as
  scripts/bench_context.py counts it), the distinct 8-grams of the output, and the geometric mean
  over the prompts. Output is checked identical to plain decoding's.
- `trace`: the engine's rounds with the n-gram drafter (greedy, the first prompt of each kind),
  each round's evidence class, tree nodes, budget, tokens emitted and time as the controller counts
  it; then by tree size the rounds, their mean tokens and median ms, beside plain decoding's median
  round from runs interleaved with them.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from bench_context import distinct_8grams, pooled_p99  # noqa: E402
from bench_spec import PROMPTS, render  # noqa: E402

import engine.round as rounds  # noqa: E402
from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.drafters.ngram import NgramDrafter  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402


@runtime_checkable
class _NoEvidence(Protocol):  # what no drafter is: swapped in for engine.round's Evidence, one controller
    def _no_drafter_has_this(self) -> int: ...


def prompts(engine: Engine, kinds: list[str]) -> list[tuple[str, list[int]]]:
    return [(kind if len(PROMPTS[kind]) == 1 else f"{kind}{i + 1}", render(engine, text))
            for kind in kinds for i, text in enumerate(PROMPTS[kind])]


Run = tuple[list[int], list[float], float, float]


def generate(engine: Engine, prompt: list[int], tokens: int, spec: SpecConfig) -> Run:
    """(output, inter-token gaps in ms, decode tok/s, tokens per forward)."""
    req = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(max_tokens=tokens, ignore_eos=True), spec=spec)
    out: list[int] = []
    gaps: list[float] = []
    last = None
    for step in engine.generate(req):
        now = time.perf_counter()
        out += step.token_ids
        if step.token_ids and last is not None:
            gaps += [(now - last) * 1e3 / len(step.token_ids)] * len(step.token_ids)
        if step.token_ids:
            last = now
        if step.stats is not None:
            stats = step.stats
    return out, gaps, stats.decode_tps, stats.tokens_per_forward


def orders(engine: Engine, kinds: list[str], tokens: int) -> None:
    print("| prompt | " + " | ".join(f"match of {n}: positions, accepted, first right" for n in (1, 2, 3, 4)) + " |")
    print("|---|---|---|---|---|")
    for label, prompt in prompts(engine, kinds):
        out = generate(engine, prompt, tokens, SpecConfig())[0]
        d = NgramDrafter()
        d.begin(prompt + out[:1])
        by: dict[int, list[int]] = collections.defaultdict(list)
        for pos in range(1, len(out) - 1):
            last = len(d.ctx) - 1
            for n in range(d.max_ngram, d.min_ngram - 1, -1):
                suffix = tuple(d.ctx[last + 1 - n :]) if last + 1 >= n else None
                ends = [e for e in d.index[n].get(suffix, ()) if e < last] if suffix else []
                if ends:
                    guess = d.ctx[ends[-1] + 1 : ends[-1] + 9]
                    by[n].append(next((i for i, (a, b) in enumerate(zip(guess, out[pos : pos + 8])) if a != b),
                                      min(len(guess), len(out) - pos)))
                    break
            d.observe([out[pos]])
        cells = [f"{len(v)}, {statistics.mean(v):.2f}, {sum(a > 0 for a in v) / len(v):.2f}" if v else "-"
                 for v in (by[n] for n in (1, 2, 3, 4))]
        print(f"| {label} | " + " | ".join(cells) + " |")


def ab(engine: Engine, kinds: list[str], tokens: int, runs: int) -> None:
    real = rounds.Evidence
    variants = {"plain": (SpecConfig(), real), "one": (SpecConfig(method="ngram"), _NoEvidence),
                "classes": (SpecConfig(method="ngram"), real)}
    cases = prompts(engine, kinds)
    res: dict[tuple[str, str], list[Run]] = collections.defaultdict(list)
    for _ in range(runs):
        for label, prompt in cases:
            for name, (spec, evidence) in variants.items():
                rounds.Evidence = evidence  # type: ignore[misc]
                try:
                    res[(label, name)].append(generate(engine, prompt, tokens, spec))
                finally:
                    rounds.Evidence = real  # type: ignore[misc]
    print(f"{tokens} greedy tokens, medians of {runs}, ratios to plain decoding paired")
    print("| prompt | method | tok/s | vs plain | tokens/forward | p99 vs plain | distinct 8-grams |")
    print("|---|---|---|---|---|---|---|")
    logs: dict[str, list[float]] = collections.defaultdict(list)
    for label, _ in cases:
        plain = res[(label, "plain")]
        for name in variants:
            rs = res[(label, name)]
            assert all(r[0] == p[0] for r, p in zip(rs, plain, strict=True)), f"{label} {name}: output differs"
            ratio = statistics.median(r[2] / p[2] for r, p in zip(rs, plain, strict=True))
            p99 = pooled_p99([r[1] for r in rs]) / pooled_p99([p[1] for p in plain])
            logs[name].append(math.log(ratio))
            print(f"| {label} | {name} | {statistics.median(r[2] for r in rs):.1f} | {ratio:.3f} | "
                  f"{statistics.median(r[3] for r in rs):.2f} | {p99:.2f}x | {distinct_8grams(plain[0][0]):.2f} |")
    print("geometric mean vs plain: " + ", ".join(f"{n} {math.exp(statistics.mean(v)):.3f}" for n, v in logs.items()))


def trace(engine: Engine, kinds: list[str], tokens: int, runs: int) -> None:
    log: list[tuple[int, int, int, int, float]] = []
    count = rounds.Rounds._count

    def logged(self, flight, accepted, emitted, t2, t3):  # the round's record, as the controller gets it
        count(self, flight, accepted, emitted, t2, t3)
        log.append((flight.evidence, flight.tree.size, flight.arm, emitted, self.last_round_ms))

    rounds.Rounds._count = logged  # type: ignore[method-assign]
    try:
        for kind in kinds:
            prompt = render(engine, PROMPTS[kind][0])
            plain_ms: list[float] = []
            eights = 0.0
            by_size: dict[int, list[tuple[int, float]]] = collections.defaultdict(list)
            for run in range(runs):
                for spec in (SpecConfig(), SpecConfig(method="ngram")):
                    log.clear()
                    output = generate(engine, prompt, tokens, spec)[0]
                    if spec.method == "none":
                        plain_ms += [r[4] for r in log]
                        eights = distinct_8grams(output)
                        continue
                    print(f"{kind}, {len(prompt)} prompt tokens, run {run + 1}: (class, nodes, budget, tokens, ms)")
                    print(" ".join(f"({e},{n},{b},{t},{ms:.1f})" for e, n, b, t, ms in log))
                    for _, n, _, t, ms in log:
                        by_size[n].append((t, ms))
            print(f"{kind}: plain round {statistics.median(plain_ms):.2f} ms (median); distinct 8-grams of the "
                  f"output {eights:.2f}")
            for n, rs in sorted(by_size.items()):
                print(f"  {n:2d} nodes: {len(rs):3d} rounds, {statistics.mean(t for t, _ in rs):.2f} tokens, "
                      f"{statistics.median(ms for _, ms in rs):.2f} ms (median)")
    finally:
        rounds.Rounds._count = count  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("orders", "ab", "trace"))
    ap.add_argument("--kinds", default="long,code,chat,math")
    ap.add_argument("--tokens", type=int, default=0, help="default: 128 (orders), 96 (ab)")
    ap.add_argument("--runs", type=int, default=0, help="default: 3 (ab), 2 (trace)")
    a = ap.parse_args()
    engine = Engine(EngineConfig(model_path=str(BUNDLED / "target"), prefix_cache=a.what == "orders"))
    kinds = [k for k in a.kinds.split(",") if k]
    if a.what == "orders":
        orders(engine, kinds, a.tokens or 128)
    elif a.what == "trace":
        trace(engine, kinds, a.tokens or 96, a.runs or 2)
    else:
        ab(engine, kinds, a.tokens or 96, a.runs or 3)


if __name__ == "__main__":
    main()
