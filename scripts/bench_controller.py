"""Two tree-size controllers side by side: the working tree's engine/spec_control.py and the round
timing that feeds it (engine/round.py) against the ones at a git revision, or against the working
tree's with a stall cap (SpecConfig.max_stall), on text where guesses miss and on text where they hit.

    python scripts/bench_controller.py --against REV [--runs 3] [--tokens 96] [--lengths 64,2048]
    python scripts/bench_controller.py --max-stall 1.5 [--runs 3] ...
    python scripts/bench_controller.py --fixed [--gate-off] [--runs 3] ...
        [--methods ngram,mtp,dflash,draft] [--kinds code,chat | none] [--fixed] [--defaults]
        [--model DIR --dflash-model DIR]

- misses: seeded sampling (temperature 1) after random-id prompts of each length, like
  scripts/bench_context.py: decode tok/s as a ratio to plain decoding (each run's to the plain run
  of its repetition, median over runs), tokens per forward, and the p99 inter-token gap over all
  runs pooled, as a ratio to plain's;
- hits: greedy on scripts/bench_spec.py's prompts (code, code-edit, math, chat, long; --kinds), or
  sampled with the checkpoint's defaults (--defaults; seeded), where greedy output loops;
- --fixed adds the working tree's engine with every round at the full budget (no controller), the
  baseline issue 17 asks the controller not to lose to where guesses hit;
- --gate-off adds the working tree's controller with the confidence gate off (engine/spec_gate.py;
  it applies to the drafters without hindsight: MTP, DFlash, the draft model).
Methods (--methods; default ngram, and mtp with DDTree trees; also mtp-chain, dflash with DDTree, and draft),
each with both controllers, interleaved with plain decoding in one process on the bundled target;
medians over runs after a warm-up. Outputs are compared with plain decoding's and a difference is
reported: in float32 on the CPU a verify row is bitwise the plain step
(tests/engine/test_lossless.py), so any difference there is a bug (one was: BENCHMARKS.md, issue
17, fifty-fifth session); in low precision a seeded draw may flip only where the uniform falls
within rounding of a CDF step (tests/unit/test_device_sampler.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from bench_context import distinct_8grams, pooled_p99  # noqa: E402
from bench_spec import PROMPTS, checkpoint_defaults, render  # noqa: E402

import engine.generate as generation  # noqa: E402
import engine.round as current  # noqa: E402
import engine.spec_gate as spec_gate  # noqa: E402
from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.spec_gate import CONF_GATE  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402

# a controller to compare: engine/round.py's module (a revision's, or the working tree's), the stall
# cap it runs with, whether it sizes the trees at all (False: every round gets the full budget), and
# the confidence gate's threshold for its runs (engine/spec_gate.py CONF_GATE; 0: no gate)
Controller = tuple[ModuleType, float | None, bool, float]

METHODS = {"ngram": SpecConfig(method="ngram"), "mtp": SpecConfig(method="mtp", tree="ddtree"),
           "mtp-chain": SpecConfig(method="mtp", tree="chain"),
           "dflash": SpecConfig(method="dflash", tree="ddtree"), "draft": SpecConfig(method="draft")}


def source_at(rev: str, path: str) -> str | None:
    """The file `path` as it was at `rev` (None where it did not exist); `rev` may also be a
    directory holding the other revision's files at the same paths (a machine without the git
    history: `git archive REV engine | tar -x -C DIR`)."""
    if Path(rev).is_dir():
        file = Path(rev) / path
        return file.read_text() if file.exists() else None
    shown = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else None


def module_at(rev: str, path: str, name: str) -> ModuleType:
    """The file `path` as it was at `rev`, loaded as its own module `name`."""
    source = source_at(rev, path)
    if source is None:
        raise FileNotFoundError(f"{path} at {rev}")
    return module_from_source(source, name)


def module_from_source(source: str, name: str) -> ModuleType:
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    return module_from_file(file, name)


def spec_control_at(rev: str, name: str) -> ModuleType:
    """engine/spec_control.py as it was at `rev`, with that revision's engine/spec_gate.py (the
    confidence gate it imports) where it had one, not the working tree's."""
    gate = source_at(rev, "engine/spec_gate.py")
    source = source_at(rev, "engine/spec_control.py")
    if source is None:
        raise FileNotFoundError(f"engine/spec_control.py at {rev}")
    if gate is not None:
        module_from_source(gate, f"{name}_gate")
        source = source.replace("from engine.spec_gate import", f"from {name}_gate import")
    return module_from_source(source, name)


def module_from_file(file: Path, name: str) -> ModuleType:
    """The Python file `file`, loaded as its own module `name`."""
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def controller_at(rev: str) -> ModuleType:
    """engine/round.py as it was at `rev`, using engine/spec_control.py and engine/spec_evidence.py
    as they were then: the controller (the n-gram drafter's per-class ones too) and the round times
    it is fed."""
    control = spec_control_at(rev, "spec_control_then")
    then = module_at(rev, "engine/round.py", "round_then")
    then.SpecController = control.SpecController  # type: ignore[attr-defined]
    evidence = source_at(rev, "engine/spec_evidence.py")
    if evidence is not None and hasattr(then, "ByEvidence"):  # its per-class controllers are that revision's too
        evidence = evidence.replace("from engine.spec_control import", "from spec_control_then import")
        then.ByEvidence = module_from_source(evidence, "spec_evidence_then").ByEvidence  # type: ignore[attr-defined]
    if not hasattr(then.Rounds, "start"):  # before rounds were started apart from their launch
        then.Rounds.start = lambda self, flight: None  # type: ignore[attr-defined]
    if "costs" not in inspect.signature(then.Rounds).parameters:  # before the engine remembered tree costs
        class Rounds(then.Rounds):  # type: ignore[name-defined]
            def __init__(self, *args, costs=None, **kwargs) -> None:
                super().__init__(*args, **kwargs)

        then.Rounds = Rounds  # type: ignore[attr-defined]
    return then


def generate(engine: Engine, prompt: list[int], params: SamplingParams, spec: SpecConfig) -> dict:
    gaps: list[float] = []
    out: list[int] = []
    last = None
    for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params, spec=spec)):
        now = time.perf_counter()
        if step.token_ids and last is not None:  # a batch of n tokens after a gap: n gaps of gap / n
            gaps += [(now - last) / len(step.token_ids) * 1e3] * len(step.token_ids)
        if step.token_ids:
            last = now
        out += step.token_ids
        if step.stats is not None:
            stats = step.stats
    return {"tps": stats.decode_tps, "tpf": stats.tokens_per_forward, "gaps": gaps, "tokens": out}


def compare(engine: Engine, prompt: list[int], params: SamplingParams, methods: list[str],
            controllers: dict[str, Controller], runs: int) -> dict[str, list[dict]]:
    """Plain decoding and every (method, controller), interleaved; the first round is a warm-up.
    A controller is `Controller`'s tuple."""
    results: dict[str, list[dict]] = {}
    for r in range(runs + 1):
        plain = generate(engine, prompt, params, SpecConfig())
        if r:
            results.setdefault("none", []).append(plain)
        for method in methods:
            spec = METHODS[method]
            for name, (module, cap, adaptive, gate) in controllers.items():
                generation.Rounds = module.Rounds  # type: ignore[attr-defined]
                spec_gate.CONF_GATE = gate
                out = generate(engine, prompt, params, replace(spec, max_stall=cap, adaptive=adaptive,
                                                               dflash_model=engine.config.spec.dflash_model))
                spec_gate.CONF_GATE = CONF_GATE
                if r:
                    results.setdefault(f"{method}:{name}", []).append(out)
    generation.Rounds = current.Rounds
    return results


def summary(results: dict[str, list[dict]]) -> dict[str, str]:
    plain_p99 = pooled_p99([x["gaps"] for x in results["none"]])
    ref = [x["tokens"] for x in results["none"]]
    cells = {"8-grams": f"{statistics.median(distinct_8grams(t) for t in ref):.2f}"}
    for key, runs in results.items():
        if key == "none":
            continue
        # each run against the plain run of its own repetition: a shared machine drifts between them
        ratio = statistics.median(x["tps"] / p["tps"] for x, p in zip(runs, results["none"], strict=True))
        p99 = pooled_p99([x["gaps"] for x in runs])
        same = sum(x["tokens"] == t for x, t in zip(runs, ref, strict=True))
        cells[key] = (f"{ratio:.2f}x, {statistics.median(x['tpf'] for x in runs):.2f}, "
                      f"{p99 / plain_p99:.2f}x" + ("" if same == len(runs) else f", {same}/{len(runs)} equal"))
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="git revision of the other controller, or a directory with its engine/")
    ap.add_argument("--max-stall", type=float, help="instead: the working tree's controller with this stall cap")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--lengths", default="64,2048")
    ap.add_argument("--methods", default="ngram,mtp", help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--kinds", default=",".join(PROMPTS), help="prompt kinds of the hits (none: misses only)")
    ap.add_argument("--fixed", action="store_true", help="also every round with the full budget (no controller)")
    ap.add_argument("--gate-off", action="store_true",
                    help="also the working tree's controller without the confidence gate (engine/spec_gate.py)")
    ap.add_argument("--defaults", action="store_true",
                    help="the hits sampled with the checkpoint's generation defaults (seed 0), not greedy")
    ap.add_argument("--model", default=str(BUNDLED / "target"), help="target checkpoint (default: the bundled one)")
    ap.add_argument("--dflash-model", default=None, help="DFlash checkpoint (default: the target's bundled one)")
    a = ap.parse_args()
    if (a.against is None) == (a.max_stall is None) and not (a.fixed or a.gate_off):
        ap.error("give one of --against, --max-stall, --fixed and --gate-off")
    methods = [m for m in a.methods.split(",") if m]
    if not methods or any(m not in METHODS for m in methods):
        ap.error(f"--methods takes some of {', '.join(METHODS)}, got {a.methods!r}")
    kinds = [k for k in a.kinds.split(",") if k and k != "none"]
    if any(k not in PROMPTS for k in kinds):
        ap.error(f"--kinds takes some of {', '.join(PROMPTS)} (or none), got {a.kinds!r}")
    controllers: dict[str, Controller] = {"now": (current, None, True, CONF_GATE)}
    if a.against:
        controllers[a.against] = (controller_at(a.against), None, True, CONF_GATE)
    elif a.max_stall is not None:
        controllers[f"cap {a.max_stall:g}"] = (current, a.max_stall, True, CONF_GATE)
    if a.fixed:
        controllers["fixed"] = (current, None, False, CONF_GATE)
    if a.gate_off:
        controllers["no gate"] = (current, None, True, 0.0)
    lengths = [int(n) for n in a.lengths.split(",") if n]  # "": no misses
    # room for the longest random prompt, and at least the engine's default for the hits' prompts
    engine = Engine(EngineConfig(model_path=a.model, prefix_cache=False, spec=SpecConfig(dflash_model=a.dflash_model),
                                 max_context=max(max(lengths, default=0) + a.tokens + 1, EngineConfig.max_context)))
    keys = ["8-grams"] + [f"{m}:{c}" for m in methods for c in controllers]
    print("cells: decode tok/s vs plain (median of the runs' ratios to the plain run beside each), tokens per "
          "forward, pooled p99 gap vs plain's; 8-grams: the distinct share of plain decoding's output")
    print("| text | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    sampled = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=1.0, seed=0)
    for n in lengths:
        prompt = [int(t) for t in np.random.RandomState(n).randint(0, engine.vocab_size, size=n)]
        cells = summary(compare(engine, prompt, sampled, methods, controllers, a.runs))
        print(f"| misses, {n} random ids | " + " | ".join(cells[k] for k in keys) + " |", flush=True)
    hits = checkpoint_defaults(engine, 0, a.tokens) if a.defaults else SamplingParams(max_tokens=a.tokens)
    for kind in kinds:
        texts = PROMPTS[kind]
        for p, text in enumerate(texts):
            cells = summary(compare(engine, render(engine, text), hits, methods, controllers, a.runs))
            label = kind if len(texts) == 1 else f"{kind}{p + 1}"
            print(f"| hits? {label} | " + " | ".join(cells[k] for k in keys) + " |", flush=True)


if __name__ == "__main__":
    main()
