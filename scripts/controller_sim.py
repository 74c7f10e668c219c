"""Tree-size controllers compared without the machine's noise: replayed over measured acceptance and
measured round times.

    python scripts/controller_sim.py record FILE [--methods mtp,draft] [--kinds code,chat] [--lengths 64] [--runs 4]
    python scripts/controller_sim.py replay FILE [--revs now,HEAD,variant.py,now+stall2] [--seeds 200]
                                                 [--offsets 0,8,16]
    python scripts/controller_sim.py confidence FILE

On the dev CPU the same controller reads 0.82x and 0.92x of plain decoding in two runs of one
process (BENCHMARKS.md, issue 17), more than the differences between controllers that issue 17 is
decided by; and a controller's choices depend on the timing noise itself, so one run of a request
is one draw of its choices. Here the engine is run once to measure, and controllers are compared on
the same measurements:

- `record` (bundled target): for each request (seeded sampling at temperature 1 after random ids,
  where guesses miss, and greedy decoding of scripts/bench_spec.py's prompts of each kind) and each
  method, the tokens a round of each of the controller's budgets emits from every position of plain
  decoding's output (a request whose prompt is the prompt and the output so far, its first round at
  that budget; the prefix cache makes that a short prefill) and the rows of that round's tree (a
  chain may stop short of its depth; replayed, the controller is told them, as the engine tells
  it; recordings without them tell none), and the wall times of rounds, by budget
  and by whether the round before was plain (pipelined) or a tree, from runs of the working tree's
  controller and from fixed budgets; plain decoding's own rounds are the denominator; and the target's
  top-token probability at every position of plain decoding's output (its confidence).
- `replay`: each controller (engine/spec_control.py at a git revision, or `now`, the working tree's)
  decides every round's budget; the round emits the recorded tokens for that budget and position and
  takes a time drawn from the recorded ones for its budget and the kind of round before it. Where the
  method's drafter has hindsight (engine/drafters/base.py `Hindsight`), a controller that takes it
  (`observe`) is told after each plain round what each of its trees would have emitted there (the
  recorded tokens at that position; the engine learns them a few rounds later); where it has not, a
  controller that takes it (`confide`) is told the target's confidence at the tokens each round
  emitted, as the engine tells it (a `/blind` suffix on a revision: not told). Over many seeds:
  tok/s as a ratio to plain decoding's (medians, 10th percentile), the tree rounds a request and the
  p99 inter-token gap against plain decoding's (each seed's gaps pooled, a round's time spread over
  its tokens; plain decoding's from the same draws of its step times), then
  by method the misses and the geometric mean of the rest. One request is one draw of where the
  re-tries fall (a re-try that lands on a right guess climbs, one a position later may not);
  `--offsets` replays each request from later start positions too (the request whose prompt ends
  with the output so far), which spreads those draws: differences of a few percent in one cell are
  that luck, not the controller.

Recordings kept in scripts/recordings/: `h200-9b-wide-4bit-mtp.json` (the H200, the 4-bit 9B-shaped
pair, MTP), `h100-9b-wide-4bit-mtp.json` (an H100, the same pair three sessions of engine work
later, MTP with DDTree trees and chains; two rounds of 1.2 and 2.4 s, tree shapes compiled on first
use, dropped), `cpu-bundled-mtp-ngram.json`, `cpu-bundled-dflash-draft.json` and
`cpu-bundled-mtp-chain.json` (the dev CPU, the bundled pair: MTP and n-gram; DFlash with DDTree
trees and the draft model; MTP chains, with each round's rows: the head's stop rule cuts them), and
`cpu-bundled-mtp-k6.json` (the dev CPU, MTP chains and DDTree trees with the head trained on six
recursive depths, shipped 2026-12-07).

What the replay leaves out: times are drawn independently (a busy stretch of the machine is not
modelled), and a round's time does not depend on how many tokens it accepted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__" and sys.argv[1:2] == ["record"]:  # a BLAS preload works only from process start
    reexec_with_openblas(sys.orig_argv[1:])

from bench_controller import METHODS, module_from_file, spec_control_at  # noqa: E402

import engine.spec_control as spec_control  # noqa: E402
import engine.spec_gate as spec_gate  # noqa: E402

BUDGETS = (1, 4, 16)  # the controller's trees at the default budget (16): SpecController(16).arms
MIN_LENGTH = 16  # a request replayed from a later offset keeps at least this many tokens


def record(path: Path, methods: list[str], kinds: list[str], lengths: list[int], runs: int, tokens: int,
           model: str | None = None, dflash_model: str | None = None) -> None:
    from dataclasses import replace

    from bench_spec import PROMPTS, render

    from engine.config import EngineConfig, SamplingParams, SpecConfig
    from engine.generate import BUNDLED, Engine
    from engine.types import GenerationRequest

    # the tables' requests share their prefixes (the prefix cache makes each a short prefill); the
    # timed requests run without one, as the benchmarks do, interleaved with plain decoding's
    context = max(max(lengths, default=0) + tokens + 1, EngineConfig.max_context)
    model = model or str(BUNDLED / "target")
    engine = Engine(EngineConfig(model_path=model, max_context=context, spec=SpecConfig(dflash_model=dflash_model)))
    timing = Engine(EngineConfig(model_path=model, prefix_cache=False, max_context=context,
                                 spec=SpecConfig(dflash_model=dflash_model)))
    requests: list[tuple[str, list[int], SamplingParams]] = []
    for n in lengths:  # as scripts/bench_controller.py's misses: the same prompts and seed
        prompt = [int(t) for t in np.random.RandomState(n).randint(0, engine.vocab_size, size=n)]
        requests.append((f"misses {n}", prompt,
                         SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=0)))
    for kind in kinds:
        for p, text in enumerate(PROMPTS[kind]):
            label = kind if len(PROMPTS[kind]) == 1 else f"{kind}{p + 1}"
            requests.append((label, render(engine, text), SamplingParams(max_tokens=tokens)))

    def output(prompt: list[int], params: SamplingParams, spec: SpecConfig) -> list[int]:
        out: list[int] = []
        for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params, spec=spec)):
            out += step.token_ids
        return out

    def confidence(prompt: list[int], params: SamplingParams, reference: list[int]) -> list[float]:
        """The target's top-token probability at each position of `reference`, from logprobs. A run
        with logprobs samples on the host and may leave the reference's tokens where the device's
        draw was a rounding flip away; the probability there is still the position's (its logits
        come from the tokens before), and the next run goes on from the reference's token."""
        top: list[float] = []
        while len(top) < len(reference):
            done = len(top)
            request = GenerationRequest(prompt_ids=prompt + reference[:done],
                                        sampling=replace(params, logprobs=1, max_tokens=len(reference) - done))
            got: list[tuple[int, float]] = []
            for step in engine.generate(request):
                got += [(t, math.exp(lp.top[0][1])) for t, lp in zip(step.token_ids, step.logprobs or [])]
            for token, p in got:
                top.append(p)
                if token != reference[len(top) - 1]:
                    break  # a flip: the next run starts after this position
            if len(top) == done:
                raise RuntimeError(f"no logprobs from position {done} of the reference on")
        return top

    def first_round(prompt: list[int], params: SamplingParams, spec: SpecConfig) -> tuple[list[int], int]:
        """The first round's tokens and its tree's rows, the root included (a chain that the
        drafter's stop rule cut short has fewer than its depth allows)."""
        rows: list[int] = []
        with counted_rounds(lambda rounds, flight, emitted: rows.append(flight.tree.size)):
            for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params, spec=spec)):
                return list(step.token_ids), rows[0]  # the generator closes: the request ends here
        return [], 1

    result: dict = {"tokens": tokens, "requests": {}}
    for label, prompt, params in requests:
        reference = output(prompt, params, SpecConfig())
        plain_ms: list[float] = []
        entry: dict = {"length": len(reference), "plain_ms": plain_ms, "methods": {}}
        entry["confidence"] = confidence(prompt, params, reference)
        for method in methods:
            spec = replace(METHODS[method], dflash_model=dflash_model)
            accepted: dict[str, list[int]] = {}
            drafted: dict[str, list[int]] = {}
            for b in BUDGETS:
                fixed = replace(spec, budget=b, adaptive=False)
                row, drafted[str(b)] = [], []
                for i in range(len(reference)):
                    got, rows = first_round(prompt + reference[:i], replace(params, max_tokens=len(reference) - i),
                                            fixed)
                    drafted[str(b)].append(rows)
                    # the tokens that agree with plain decoding's (a rounding flip ends the agreement)
                    n = next((k for k, t in enumerate(got) if i + k >= len(reference) or t != reference[i + k]),
                             len(got))
                    row.append(max(1, n))
                accepted[str(b)] = row
            times: dict[str, list[float]] = {}
            for _ in range(runs):
                plain_ms += [ms for _, _, ms in timed_rounds(timing, prompt, params, SpecConfig())]
                for timed_spec in [spec] + [replace(spec, budget=b, adaptive=False) for b in BUDGETS]:
                    prev = None
                    for budget, _, ms in timed_rounds(timing, prompt, params, timed_spec):
                        kind = "start" if prev is None else ("plain" if prev == 0 else "tree")
                        times.setdefault(f"{budget}:{kind}", []).append(ms)
                        prev = budget
            entry["methods"][method] = {"accepted": accepted, "rows": drafted, "ms": times}
            print(f"{label} {method}: tokens a round at budgets {BUDGETS}: "
                  + ", ".join(f"{statistics.mean(r):.2f}" for r in accepted.values()), flush=True)
        result["requests"][label] = entry
        path.write_text(json.dumps(result))  # after every request: a run cut off keeps what it measured


@contextlib.contextmanager
def counted_rounds(seen: Callable[[Any, Any, int], object]) -> Iterator[None]:
    """Within the block, `seen(rounds, flight, emitted)` after each round engine/round.py counts."""
    import engine.round as rounds_module

    count = rounds_module.Rounds._count

    def counted(self, flight, accepted, emitted, t2, t3) -> None:  # noqa: ANN001
        count(self, flight, accepted, emitted, t2, t3)
        seen(self, flight, emitted)

    rounds_module.Rounds._count = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        rounds_module.Rounds._count = count  # type: ignore[method-assign]


def timed_rounds(engine, prompt, params, spec) -> list[tuple[int, int, float]]:  # noqa: ANN001
    """Every round of one request: its budget (the controller's arm, else the tree's nodes besides
    the root), the tokens it emitted and its time as engine/round.py hands it to the controller."""
    from engine.types import GenerationRequest

    out: list[tuple[int, int, float]] = []

    def timed(rounds, flight, emitted) -> None:  # noqa: ANN001
        budget = flight.arm if rounds.controller is not None and flight.arm >= 0 else flight.tree.size - 1
        out.append((budget, emitted, rounds.last_round_ms))

    with counted_rounds(timed):
        for _ in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params, spec=spec)):
            pass
    return out


def row_cap(method: str) -> int | None:
    """The rows of a chain of one of METHODS (its depth and its root, as engine/round.py hands
    them over), None for trees that fill their budget: a chain stops at the method's default depth
    (engine/config.py; the bundled DFlash block of 16 holds 15 guesses, more than that)."""
    spec = METHODS[method]
    return spec.max_depth + 1 if spec.tree == "chain" and spec.method in ("mtp", "dflash") else None


def hindsight(method: str) -> bool:
    """Whether the drafter of one of METHODS tells what its guesses would have done in plain rounds."""
    from engine.drafters import DRAFTER_TYPES
    from engine.drafters.base import Hindsight

    return issubclass(DRAFTER_TYPES[METHODS[method].method], Hindsight)


def by_budget(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Round times keyed by BUDGETS. A chain's tree at the biggest budget has as many nodes as its
    depth allows (6 for MTP), and the engine reports its rounds by that size: those are the biggest
    budget's rounds."""
    top = max(BUDGETS)
    if any(k.startswith(f"{top}:") for k in times):
        return times
    sizes = {int(k.split(":")[0]) for k in times}
    counts = {b: sum(len(v) for k, v in times.items() if int(k.split(":")[0]) == b) for b in sizes}
    biggest = max((b for b in sizes if b > BUDGETS[-2]), key=lambda b: counts[b], default=None)
    if biggest is None:
        return times
    return {(f"{top}:{k.split(':')[1]}" if int(k.split(":")[0]) == biggest else k): v for k, v in times.items()}


def replay_one(controller_class: type, accepted: dict[str, list[int]], times: dict[str, list[float]],
               length: int, rng: random.Random, hindsight: bool = False,
               confidence: list[float] | None = None, costs: object | None = None,
               row_cap: int | None = None, drafted: dict[str, list[int]] | None = None,
               gaps: list[float] | None = None) -> tuple[float, int]:
    """One request under `controller_class`: its total ms and its tree rounds; `gaps`, where given,
    gets each token's inter-token gap (a round's time spread over the tokens it emits, as
    scripts/bench_context.py counts them: the tail a streaming client sees). `hindsight`: the
    controller is told after each plain round what each tree would have emitted there. `costs`:
    what earlier requests measured of the trees (engine/spec_control.py RoundCosts), shared.
    `row_cap`: a chain's rows (its depth and root), as the engine hands it to the controller.
    `drafted`: each budget's tree rows at each position where the recording has them (a chain the
    drafter's stop rule cut short is that short), told to the controller with each round as the
    engine tells it; else the controller takes the budget's."""
    kwargs: dict = {} if costs is None else {"costs": costs}
    if row_cap is not None and "row_cap" in inspect.signature(controller_class).parameters:
        kwargs["row_cap"] = row_cap
    controller = controller_class(max(BUDGETS), **kwargs)
    observe = getattr(controller, "observe", None) if hindsight else None
    confide = getattr(controller, "confide", None) if confidence else None
    if drafted is not None and "rows" not in inspect.signature(controller.record).parameters:
        drafted = None  # a controller from before rows were told
    i, total, trees, prev = 0, 0.0, 0, None
    while i < length:
        arm = controller.budget()
        room = length - i
        budget = max(0, min(arm, room - 1))
        if budget and str(budget) not in accepted:  # a budget cut by the room: the nearest tree below
            budget = max(b for b in BUDGETS if b <= budget)
        emitted = min(room, accepted[str(budget)][i] if budget else 1)
        kind = "start" if prev is None else ("plain" if prev == 0 else "tree")
        pool = times.get(f"{budget}:{kind}") or [ms for k, v in times.items() if k.startswith(f"{budget}:") for ms in v]
        ms = rng.choice(pool)
        rows = (drafted[str(budget)][i],) if drafted is not None and budget else ()
        controller.record(arm if budget == arm else -1, emitted, ms, *rows)
        if observe is not None and budget == 0:  # what each tree would have emitted here
            observe([(b, accepted[str(b)][i]) for b in BUDGETS])
        if confide is not None:
            confide(confidence[i : i + emitted])
        total += ms
        if gaps is not None:
            gaps += [ms / emitted] * emitted
        trees += budget > 0
        i += emitted
        prev = budget
    return total, trees


class FixedBudget:
    """No controller: every round gets the full budget (SpecConfig.adaptive off)."""

    def __init__(self, max_budget: int) -> None:
        self.max_budget = max_budget

    def budget(self) -> int:
        return self.max_budget

    def record(self, budget: int, tokens: int, ms: float) -> None:
        pass


def controller_class(rev: str) -> type:
    """engine/spec_control.py's SpecController at git revision `rev`, the working tree's (`now`), that
    of a file (a variant being tried), or none (`fixed`); a `/blind` suffix: the same, not told the
    target's confidence; a `+stallX` suffix: with a stall cap of X plain rounds a round
    (`max_stall`), `+tokstallX`: of X plain rounds a token the round is expected to emit
    (`per_token_stall`, a variant tried in the fifty-second session and left out of the engine)."""
    rev = rev.removesuffix("/blind")
    for mark, make in (("+tokstall", per_token_stall), ("+stall", with_stall_cap)):
        if mark in rev:
            base, cap = rev.split(mark)
            return make(controller_class(base), float(cap))
    if rev == "now":
        return spec_control.SpecController
    if rev == "fixed":
        return FixedBudget
    name = f"spec_control_{len(sys.modules)}"
    module = module_from_file(Path(rev), name) if rev.endswith(".py") else spec_control_at(rev, name)
    return module.SpecController


def with_stall_cap(base: type, cap: float) -> type:
    """`base` with max_stall `cap` by default (the engine's `--spec-max-stall`)."""
    cls = dataclasses.make_dataclass(base.__name__, [("max_stall", float | None, dataclasses.field(default=cap))],
                                     bases=(base,))
    cls.__module__ = base.__module__  # its RoundCosts (`remembers`)
    return cls


def per_token_stall(base: type, cap: float) -> type:
    """`base` whose trees are allowed (`_allowed`) where a round takes at most `cap` plain rounds
    for each token it is expected to emit (SpecController.tokens), instead of `cap` plain rounds a
    round: where a tree's rounds emit several tokens its stall is spread over them."""

    class PerTokenStall(base):  # type: ignore[misc, valid-type]
        def _allowed(self, arm) -> bool:  # noqa: ANN001
            # the base's rule (measured or predicted time against max_stall plain rounds), its cap
            # scaled by the arm's tokens a round; max_stall is read nowhere else
            self.max_stall = cap * max(1.0, self.tokens(arm)[0])
            return super()._allowed(arm)

    PerTokenStall.__module__ = base.__module__
    return PerTokenStall


def remembers(cls: type) -> type | None:
    """The RoundCosts class of a controller class's module, where its controllers take one."""
    costs = getattr(sys.modules.get(cls.__module__), "RoundCosts", None)
    return costs if costs is not None and "costs" in inspect.signature(cls).parameters else None


def replay(path: Path, revs: list[str], seeds: int, offsets: list[int], remember: bool = False) -> None:
    """The table of every request and method, then a summary by method (see `summary`).
    `remember`: the controllers that take what earlier requests measured of the trees (RoundCosts)
    share it across the seeds of a request, after one request replayed to fill it, as an engine
    answering the same request again would."""
    data = json.loads(path.read_text())
    classes = {rev: controller_class(rev) for rev in revs}
    medians: dict[str, dict[tuple[str, str], float]] = {rev: {} for rev in revs}
    print(f"cells: tok/s vs plain decoding, median over {seeds} seeds x {len(offsets)} start offsets "
          "(10th percentile), tree rounds a request, p99 inter-token gap pooled over the seeds against "
          "plain decoding's")
    header = ["request", "method"] + revs
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for label, entry in data["requests"].items():
        plain = entry["plain_ms"]
        for method, m in entry["methods"].items():
            m = {**m, "ms": by_budget(m["ms"])}
            cells = []
            # a drafter with hindsight is told that; the others the confidence, as the engine does
            told = hindsight(method)
            cap = row_cap(method)
            for rev, cls in classes.items():
                ratios, trees, gaps, plain_gaps = [], [], [], []
                blind = rev.endswith("/blind")
                # from a later offset, the request whose prompt ends with the output so far: the
                # recorded tokens from there on are that request's, and the controller starts fresh
                for offset in [o for o in offsets if o == 0 or o <= entry["length"] - MIN_LENGTH]:
                    accepted = {b: row[offset:] for b, row in m["accepted"].items()}
                    drafted = {b: row[offset:] for b, row in m["rows"].items()} if "rows" in m else None
                    length = entry["length"] - offset
                    confidence = entry["confidence"][offset:] if "confidence" in entry and not blind else None
                    memory = remembers(cls) if remember else None
                    costs = None if memory is None else memory()
                    if costs is not None:  # one request to fill it
                        replay_one(cls, accepted, m["ms"], length, random.Random(-1), told,
                                   None if told else confidence, costs, cap, drafted)
                    for seed in range(seeds):
                        rng = random.Random(seed)
                        total, n = replay_one(cls, accepted, m["ms"], length, rng, told,
                                              None if told else confidence, costs, cap, drafted, gaps)
                        plain_steps = [rng.choice(plain) for _ in range(length)]
                        plain_gaps += plain_steps
                        plain_total = sum(plain_steps)
                        ratios.append(plain_total / total)
                        trees.append(n)
                ratios.sort()
                medians[rev][(label, method)] = statistics.median(ratios)
                cells.append(f"{statistics.median(ratios):.3f}x ({ratios[len(ratios) // 10]:.3f}), "
                             f"{statistics.mean(trees):.1f}, p99 {p99(gaps) / p99(plain_gaps):.2f}x")
            print(f"| {label} | {method} | " + " | ".join(cells) + " |")
    print()
    print(summary(medians))


def p99(gaps: list[float]) -> float:
    """The gap 1 % of tokens wait at least, pooled (scripts/bench_context.py's pooled p99)."""
    ordered = sorted(gaps)
    return ordered[int(len(ordered) * 0.99)]


def by_confidence(path: Path, keep: float, edges: list[float]) -> str:
    """Tokens a round of each budget by the target's confidence before the position (its moving
    average over the positions before, `keep` of the history a token, as engine/spec_control.py
    keeps it), by method over every recorded position."""
    data = json.loads(path.read_text())
    rows: dict[str, list[tuple[float, dict[str, int]]]] = {}
    for entry in data["requests"].values():
        confidence = entry.get("confidence")
        if confidence is None:
            continue
        for method, m in entry["methods"].items():
            average = None
            for i in range(entry["length"]):
                if average is not None:
                    rows.setdefault(method, []).append((average, {b: r[i] for b, r in m["accepted"].items()}))
                average = confidence[i] if average is None else keep * average + (1 - keep) * confidence[i]
    budgets = [str(b) for b in BUDGETS]
    lines = ["| method | confidence before | positions | " + " | ".join(f"tokens at {b}" for b in budgets) + " |",
             "|---|---|---|" + "---|" * len(budgets)]
    for method, samples in rows.items():
        for lo, hi in zip(edges, edges[1:]):
            cell = [t for c, t in samples if lo <= c < hi]
            means = [statistics.mean(t[b] for t in cell) if cell else float("nan") for b in budgets]
            tokens = " | ".join(f"{v:.2f}" for v in means)
            lines.append(f"| {method} | {lo:.1f}-{hi:.1f} | {len(cell)} | {tokens} |")
    return "\n".join(lines)


def summary(medians: dict[str, dict[tuple[str, str], float]]) -> str:
    """By method and controller: the misses' cells (requests labelled "misses ...") and the
    geometric mean of the other requests' (where guesses may hit), with its ratio to the fixed
    budget's where `fixed` was replayed too."""
    methods = sorted({method for cells in medians.values() for _, method in cells})
    lines = ["| method | controller | misses | hits? (geomean) | hits? vs fixed (geomean) |", "|---|---|---|---|---|"]
    fixed = medians.get("fixed")
    for method in methods:
        for rev, cells in medians.items():
            misses = [v for (label, m), v in cells.items() if m == method and label.startswith("misses")]
            hits = {k: v for k, v in cells.items() if k[1] == method and not k[0].startswith("misses")}
            gm = math.exp(statistics.mean(math.log(v) for v in hits.values())) if hits else float("nan")
            vs = math.exp(statistics.mean(math.log(v / fixed[k]) for k, v in hits.items())) \
                if fixed and hits else float("nan")
            lines.append(f"| {method} | {rev} | {' / '.join(f'{v:.3f}' for v in misses)} | {gm:.3f} | {vs:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="measure acceptance and round times on the bundled target (or --model)")
    rec.add_argument("file", type=Path)
    rec.add_argument("--methods", default="mtp,draft", help=f"of {', '.join(METHODS)}")
    rec.add_argument("--kinds", default="code,chat", help="scripts/bench_spec.py prompt kinds (none: misses only)")
    rec.add_argument("--lengths", default="64", help="random-id prompt lengths of the misses (\"\": none)")
    rec.add_argument("--runs", type=int, default=4, help="requests of each kind timed per method and budget")
    rec.add_argument("--tokens", type=int, default=96)
    rec.add_argument("--model", help="target checkpoint (default: the bundled one)")
    rec.add_argument("--dflash-model", help="DFlash checkpoint (default: the target's bundled one)")
    rep = sub.add_parser("replay", help="compare controllers over a recording")
    rep.add_argument("file", type=Path)
    rep.add_argument("--revs", default="now,HEAD",
                     help="git revisions of engine/spec_control.py, `now` (the working tree's), "
                     "`fixed` (the full budget every round) or files")
    rep.add_argument("--seeds", type=int, default=200)
    rep.add_argument("--remember", action="store_true",
                     help="the tree costs earlier requests measured (RoundCosts) shared across each request's seeds")
    rep.add_argument("--offsets", default="0",
                     help="start positions each request is also replayed from (e.g. 0,6,12,18,24,30,36,42)")
    conf = sub.add_parser("confidence", help="tokens a round by the target's confidence before the position")
    conf.add_argument("file", type=Path)
    conf.add_argument("--keep", type=float, default=spec_gate.CONF_KEEP)
    conf.add_argument("--edges", default="0,0.3,0.5,0.7,0.9,1.01")
    a = ap.parse_args()
    if a.command == "confidence":
        print(by_confidence(a.file, a.keep, [float(e) for e in a.edges.split(",")]))
    elif a.command == "record":
        methods = [m for m in a.methods.split(",") if m]
        if not methods or any(m not in METHODS for m in methods):
            ap.error(f"--methods takes some of {', '.join(METHODS)}, got {a.methods!r}")
        kinds = [k for k in a.kinds.split(",") if k and k != "none"]
        record(a.file, methods, kinds, [int(n) for n in a.lengths.split(",") if n], a.runs, a.tokens, a.model,
               a.dflash_model)
    else:
        replay(a.file, [r for r in a.revs.split(",") if r], a.seeds, [int(o) for o in a.offsets.split(",") if o],
               a.remember)


if __name__ == "__main__":
    main()
