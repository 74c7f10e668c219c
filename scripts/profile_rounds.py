"""Where a speculation round's wall time goes, phase by phase, as the engine runs it.

    python scripts/profile_rounds.py [--methods none,dflash:ddtree,mtp:ddtree] [--budget 16]
        [--model DIR --dflash-model DIR] [--tokens 128] [--runs 2] [--kinds code] [--dtype float32]
        [--adaptive] [--json OUT.json] [--variants engine,ev0,ev2,fold0,ev0-fold0] [--cprofile OUT.txt]

bench_spec.py says how much of a round is drafting, verifying and committing; this script splits
those further by wrapping the engine's functions with wall-clock timers (nothing is synchronised
that the engine does not synchronise itself, so the phases add up to what a request sees):

- `propose`   the drafter's whole proposal (its catch-up, the draft pass, the tree);
- `marginals` inside it, the draft pass's top-k reaching the host (its evaluation: the device's
              draft time and the round trip, for DFlash and the MTP head);
- `build`     inside it, the tree builder on the host (chain, DDTree, Weaver's);
- `verify`    building the verify's lazy graph (forward.verify: positions, masks, every layer);
- `queue`     the rest of queueing the round (the device choice's graph, handing it over);
- `land`      the landing: waiting for the node choices, the accept walk, the commit, observe;
- `walk`, `commit`  inside it, the accept walk and building the commit;
- `encode`    every `mx.async_eval` call's time, wherever it falls (inside `verify` on GPUs, which
              hand a verify to the device every few layers; in the queueing and the landing): the
              host encoding launches, or waiting where MLX makes it wait for the device;
- `round`     a round's wall time from its launch to the end of its landing (pipelined plain rounds
              overlap, so theirs is read from the gaps between landings).
Each row also gives tokens per forward pass, the distinct 8-gram share of the output (tokens
per forward are honest only on output that does not loop), and `same`: how many leading tokens its
output shares with the prompt's first row (its first method and variant).

Runs the bundled target and drafters (or `--model`'s, e.g. scripts/widen_checkpoint.py's 9B-wide
pair) on bench_spec.py's prompts, greedy (or with the checkpoint's sampling defaults and a seed:
`--defaults --seed N`), one warm-up generation of
each prompt, method and variant, then `--runs` measured ones; prints ms a round (mean over the
measured rounds) per phase, method and variant. `--variants` compares engine settings in one
process, interleaved run by run, named by the variant suffixes of scripts/variants.py:
`evN` hands a multi-node verify to the device every N layers whatever the model's size (0 = once),
`fold0` / `fold1` run each GDN commit on its own / folded into the next verify, joined with `-`;
`engine` is the engine as it is. Two suffixes are this script's own: `hdN` sleeps N ms (decimals
with `p`: `hd0p5`) in the host's graph building of every decode and verify forward pass, half way
through its layers, after the first half was handed to the device (a round that grows by the
sleep waited for the host; one that does not, for the device, whose queued work absorbed it);
`ds1` hands a chain drafted on the device to it as soon as it is built, not with the verify's
first layers. `--cprofile` profiles the first variant's
multi-node verifies' graph building. Made for the H200, where the bundled target's rounds are
bound by small launches and the host, not by reading weights.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402

import engine.drafters.dflash as dflash_drafter  # noqa: E402
import engine.drafters.marginals as marginals  # noqa: E402
import engine.forward as forward  # noqa: E402
import engine.round as rounds  # noqa: E402
import engine.sampler as sampler  # noqa: E402
from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402
from scripts.bench_spec import (  # noqa: E402
    PROMPTS,
    checkpoint_defaults,
    distinct_8grams,
    parse_methods,
    render,
    warm_like_serve,
)
from scripts.variants import variant_setting  # noqa: E402

TOTALS: dict[str, float] = defaultdict(float)
ROUNDS: list[float] = []  # wall ms of each landed round (launch or previous landing -> its landing)
LAST = {"landed": 0.0}


def timed(owner: Any, name: str, label: str) -> None:
    """Replace owner.name by a wrapper adding its wall time to TOTALS[label]."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TOTALS[label] += (time.perf_counter() - t) * 1e3

    setattr(owner, name, wrapper)


def instrument() -> None:
    land, queue = rounds.Rounds.land, rounds.Rounds._queue

    def timed_land(self: rounds.Rounds, flight: rounds.InFlight) -> rounds.RoundResult:
        t = time.perf_counter()
        r = land(self, flight)
        end = time.perf_counter()
        TOTALS["land"] += (end - t) * 1e3
        start = max(flight.t_start, LAST["landed"])
        ROUNDS.append((end - start) * 1e3)
        LAST["landed"] = end
        return r

    def timed_queue(self: rounds.Rounds, *args: Any) -> rounds.InFlight:
        t = time.perf_counter()
        before = TOTALS["verify"]
        f = queue(self, *args)
        TOTALS["queue"] += (time.perf_counter() - t) * 1e3 - (TOTALS["verify"] - before)
        return f

    rounds.Rounds.land, rounds.Rounds._queue = timed_land, timed_queue
    timed(mx, "async_eval", "encode")  # the engine looks mx.async_eval up at every call
    timed(forward, "verify", "verify")
    timed(forward, "commit", "commit")
    timed(sampler, "accept_walk", "walk")
    timed(marginals.Marginals, "from_logits", "marginals")
    import engine.drafters as drafters

    for name in ("chain", "ddtree"):
        timed(marginals, name, "build")
        drafters.BUILDERS[name] = getattr(marginals, name)  # the table holds the functions themselves
    for cls in _drafter_classes():
        timed(cls, "propose", "propose")
        if hasattr(cls, "chain_on_device"):  # a chain drafted on the device: its graph building
            timed(cls, "chain_on_device", "propose")


def same_prefix(output: list[int], reference: list[int]) -> int:
    """How many leading tokens `output` shares with `reference` (all of them: the same output). In
    bf16 a kernel that rounds differently may flip a near-tie; this column shows where."""
    return next((i for i, (a, b) in enumerate(zip(output, reference, strict=False)) if a != b),
                min(len(output), len(reference)))


def _drafter_classes() -> list[type]:
    from engine.drafters.mtp import MTPDrafter
    from engine.drafters.ngram import NgramDrafter

    return [dflash_drafter.DFlashDrafter, MTPDrafter, NgramDrafter]


PROFILING = {"on": False}
PROBES = {"delay_ms": 0.0, "draft_start": False}


def probe_setting(variant: str) -> None:
    """This script's own variant suffixes (see the docstring): hdN, dsN."""
    PROBES["delay_ms"], PROBES["draft_start"] = 0.0, False
    for suffix in variant.split("-"):
        if suffix.startswith("hd"):
            PROBES["delay_ms"] = float(suffix[2:].replace("p", "."))
        elif suffix.startswith("ds"):
            PROBES["draft_start"] = suffix[2:] == "1"


def install_probes(engine: Any) -> None:
    """The sleep half way through a decode or verify pass's layers, and the early draft start."""
    from engine.drafters.mtp import MTPDrafter
    from engine.models.qwen3_5 import DecoderLayer

    layers = engine.model.model.layers
    middle = layers[len(layers) // 2]
    layer_call = DecoderLayer.__call__

    def call(self: Any, x: Any, cache: Any, batch: Any) -> Any:
        if self is middle and PROBES["delay_ms"] and batch.mode(x.shape[1]) != "chain":
            time.sleep(PROBES["delay_ms"] / 1e3)
        return layer_call(self, x, cache, batch)

    DecoderLayer.__call__ = call  # type: ignore[method-assign]
    chain_on_device = MTPDrafter.chain_on_device

    def chain(self: Any, *args: Any) -> Any:
        tokens = chain_on_device(self, *args)
        if tokens is not None and PROBES["draft_start"]:
            mx.async_eval(tokens)
        return tokens

    MTPDrafter.chain_on_device = chain  # type: ignore[method-assign]


def profiled_verify() -> cProfile.Profile:
    """A profiler switched on around every multi-node verify's graph building while measuring (the
    first variant's runs)."""
    profiler, inner = cProfile.Profile(), forward.verify

    def verify(model: Any, cache: Any, tree: Any, *args: Any, **kwargs: Any) -> Any:
        if not (PROFILING["on"] and tree.size > 1):
            return inner(model, cache, tree, *args, **kwargs)
        profiler.enable()
        try:
            return inner(model, cache, tree, *args, **kwargs)
        finally:
            profiler.disable()

    forward.verify = verify
    return profiler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="none,dflash:chain,dflash:ddtree,mtp:ddtree")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depth", type=int, default=0, help="tree depth (0: each method's default)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--kinds", default="code")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--adaptive", action="store_true")
    ap.add_argument("--defaults", action="store_true",
                    help="sample with the checkpoint's generation_config and --seed instead of greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="engine",
                    help="engine settings to compare, interleaved run by run: engine (as it is), or "
                         "scripts/variants.py's suffixes joined with -, e.g. engine,ev0,fold0,ev0-fold0")
    ap.add_argument("--cprofile", type=Path, help="write a cProfile of the measured verifies' graph building here")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--model", default=str(BUNDLED / "target"), help="target checkpoint (default: the bundled one)")
    ap.add_argument("--dflash-model", default=None, help="DFlash checkpoint (default: the target's bundled one)")
    a = ap.parse_args()
    a.draft_model = None
    instrument()
    variants = a.variants.split(",")
    profiler = profiled_verify() if a.cprofile else None
    engine = Engine(EngineConfig(model_path=a.model, dtype=a.dtype, spec=SpecConfig(dflash_model=a.dflash_model)))
    install_probes(engine)
    specs = parse_methods(a.methods, [a.budget], a.depth, a)
    warm_like_serve(engine, specs.values())
    # the tree builders are looked up when a drafter is made: the wrappers above are already in place
    base = SamplingParams(temperature=0.0, max_tokens=a.tokens)
    decoding = "greedy"
    if a.defaults:
        base = checkpoint_defaults(engine, a.seed, a.tokens)
        decoding = (f"sampled (temperature {base.temperature}, top_p {base.top_p}, top_k {base.top_k}, "
                    f"repetition penalty {base.repetition_penalty}, seed {a.seed})")
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(a).items()}, "rows": []}
    print(f"ms a round (mean over measured rounds), {a.tokens} tokens {decoding}, budget {a.budget}, dtype {a.dtype}")
    print(f"{'prompt':8} {'method':18} {'variant':14} {'same':>4} {'rounds':>6} {'tok/fwd':>7} {'8-gram':>6} "
          f"{'tok/s':>7} {'round':>6} {'med':>6} {'propose':>7} "
          f"{'margin':>7} {'build':>6} {'verify':>6} {'queue':>6} {'land':>6} {'walk':>6} {'commit':>6} {'encode':>6}")
    for kind in a.kinds.split(","):
        for p, text in enumerate(PROMPTS[kind]):
            prompt = render(engine, text)
            label = kind if len(PROMPTS[kind]) == 1 else f"{kind}{p + 1}"
            reference: list[int] | None = None  # the first row's output: every other row's is held to it
            for name, spec in specs.items():
                req = GenerationRequest(prompt_ids=prompt, sampling=base, spec=spec)
                for variant in variants:  # warm-up: compiles this prompt's tree shapes in every variant
                    probe_setting(variant)
                    with variant_setting(f"engine-{variant}"):
                        list(engine.generate(req))
                seen: dict[str, dict[str, Any]] = {v: {"totals": defaultdict(float), "rounds": [], "tokens": 0,
                                                       "output": [], "tps": []} for v in variants}
                for _ in range(a.runs):
                    for variant in variants:  # interleaved, so that a drifting machine hits them alike
                        TOTALS.clear()
                        ROUNDS.clear()
                        LAST["landed"] = 0.0
                        PROFILING["on"] = variant == variants[0]
                        record = seen[variant]
                        output = []
                        probe_setting(variant)
                        with variant_setting(f"engine-{variant}"):
                            for step in engine.generate(req):
                                output += step.token_ids
                                if step.stats is not None:
                                    record["tps"].append(step.stats.decode_tps)
                        PROFILING["on"] = False
                        record["tokens"] += len(output)
                        record["output"] = output
                        record["rounds"] += ROUNDS[1:]  # the first round's start includes the prefill's
                        for k, v in TOTALS.items():
                            record["totals"][k] += v
                for variant, record in seen.items():
                    reference = record["output"] if reference is None else reference
                    n = len(record["rounds"])
                    per = {k: v / n for k, v in record["totals"].items()}
                    row = {"prompt": label, "method": name, "variant": variant, "rounds": n,
                           "tok_fwd": record["tokens"] / (n + a.runs), "tok_s": statistics.median(record["tps"]),
                           "round_ms": statistics.mean(record["rounds"]),
                           "round_median_ms": statistics.median(record["rounds"]),
                           "distinct_8grams": round(distinct_8grams(record["output"]), 3),
                           "same_prefix": same_prefix(record["output"], reference),
                           **{f"{k}_ms": round(v, 3) for k, v in per.items()}}
                    report["rows"].append(row)
                    print(f"{label:8} {name:18} {variant:14} {row['same_prefix']:4d} {n:6d} {row['tok_fwd']:7.2f} "
                          f"{row['distinct_8grams']:6.2f} {row['tok_s']:7.1f} {row['round_ms']:6.2f} "
                          f"{row['round_median_ms']:6.2f} " + " ".join(
                              f"{per.get(k, 0.0):{w}.2f}" for k, w in
                              (("propose", 7), ("marginals", 7), ("build", 6), ("verify", 6), ("queue", 6),
                               ("land", 6), ("walk", 6), ("commit", 6), ("encode", 6))), flush=True)
                if a.json:
                    a.json.write_text(json.dumps(report, indent=1))
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(40)
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(60)
        a.cprofile.write_text(out.getvalue())


if __name__ == "__main__":
    main()
