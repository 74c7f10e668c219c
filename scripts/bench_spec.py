"""Speculation benchmark: every drafter and tree builder against plain decoding, side by side in one
run, per prompt kind.

    python scripts/bench_spec.py [--model DIR] [--draft-model DIR]
        [--dflash-model DIR] [--tokens 128] [--runs 3] [--budgets 16,32] [--depth N]
        [--methods none,ngram,draft,draft-tree,mtp:chain,mtp:ddtree,dflash:chain,dflash:ddtree,dflash:weaver]
        [--temperature 0 --seed 0] [--defaults] [--adaptive] [--mlx-lm] [--json OUT.json] [--png OUT.png]

A method is METHOD[:TREE], optionally with /vN (a draft vocabulary of N tokens) and /dN (its own
tree depth, else --depth's): `mtp:chain,mtp:chain/d10` compares two depths in one run.
Defaults to the bundled target and its drafters. Greedy decoding (or sampling with --temperature and a
fixed seed: position-keyed noise makes every method emit the same tokens; --defaults samples with
the checkpoint's generation_config.json, as a request that sets nothing does), chat template with
thinking off, stopping at the end of the answer. Methods run interleaved (run 1 of every method, then run 2, ...)
so that the noise of a shared machine hits them alike. Reported per prompt kind and method:
- tok/s: decode tokens per second (the first token excluded), median over runs, and the ratio to
  plain decoding (`none`) measured in the same run;
- tok/fwd: tokens emitted per target forward pass (accepted drafts + the bonus token);
- draft%: drafting's share of the decode time (incl. the drafter's own catch-up);
- ITL p50 / p99 (ms): gaps between consecutive tokens as a streaming client sees them (a round's
  tokens arrive together, so speculation moves latency into the tail);
- 8-gram: the share of distinct 8-grams in the output (speculation figures are honest only on
  output that does not loop);
- same: the output is identical to plain decoding's.
The PNG shows, per method, the histogram of tokens emitted per round over all prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402


def long_context_prompt() -> str:
    import textwrap as source_module

    source = inspect.getsource(source_module)[:6000]
    return (f"Here is a module:\n```python\n{source}\n```\n"
            "Write a python function to wrap a paragraph of text to a given width.")


PROMPTS = {
    "code": ["Write a python function to merge two sorted lists",
             "Write a python function to return the number of lines in a text file",
             "Write a Python function that parses a query string into a dictionary."],
    "code-edit": ["Rename the variable `total` to `acc` in this function:\n```python\ndef add_all(xs):\n"
                  "    total = 0\n    for x in xs:\n        total = total + x\n    return total\n```"],
    "math": ["Compute 12 * 13 step by step, then 14 * 15, then 16 * 17."],
    "chat": ["Tell me about your favourite season and why you like it."],
    "long": [long_context_prompt()],
}
DEFAULT_METHODS = "none,ngram,draft,draft-tree,mtp:chain,mtp:ddtree,dflash:chain,dflash:ddtree,dflash:weaver"


@dataclass
class Run:
    tokens: list[int]
    tps: float
    tpf: float
    draft_share: float
    gaps_ms: list[float]  # per emitted token after the first: time since the previous token
    per_round: list[int]  # tokens emitted by each round
    verify_share: float = 0.0  # the rest of the decode time, as the engine splits it (Stats)
    commit_share: float = 0.0
    round_ms: float = 0.0  # decode time per target forward pass


@dataclass
class Result:
    runs: list[Run] = field(default_factory=list)


def render(engine: Engine, text: str) -> list[int]:
    from server.chat import ChatRenderOptions, ChatTemplate

    template = ChatTemplate(engine.tokenizer.chat_template)
    text = template.render([{"role": "user", "content": text}], ChatRenderOptions(enable_thinking=False))
    return engine.tokenizer.encode(text)


def one(engine: Engine, prompt: list[int], spec: SpecConfig, n: int, base: SamplingParams) -> Run:
    req = GenerationRequest(prompt_ids=prompt, sampling=dataclasses.replace(base, max_tokens=n), spec=spec)
    tokens, gaps, per_round = [], [], []
    t_first = t_last = None
    for step in engine.generate(req):
        now = time.perf_counter()
        if step.token_ids:
            if t_first is None:
                t_first, first_n = now, len(step.token_ids)
            else:
                gaps += [(now - t_last) * 1e3] + [0.0] * (len(step.token_ids) - 1)
                per_round.append(len(step.token_ids))
            t_last = now
        tokens += step.token_ids
    stats = step.stats
    dt = (t_last or 0) - (t_first or 0)
    tps = (len(tokens) - first_n) / dt if dt > 0 else 0.0
    ms = stats.decode_ms if stats.decode_ms > 0 else float("inf")
    return Run(tokens, tps, stats.tokens_per_forward, stats.draft_ms / ms, gaps, per_round,
               stats.verify_ms / ms, stats.commit_ms / ms, stats.decode_ms / max(1, stats.forward_passes))


def mlx_lm_one(model, prompt: list[int], n: int) -> Run:
    """Plain decoding by mlx-lm (greedy), timed as `one` times the engine."""
    from bench_decode import mlx_lm_timed

    tokens, times = mlx_lm_timed(model, prompt, n)
    gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    dt = times[-1] - times[0]
    return Run(tokens, (len(tokens) - 1) / dt if dt > 0 else 0.0, 1.0, 0.0, gaps, [1] * len(gaps))


def checkpoint_defaults(engine: Engine, seed: int, max_tokens: int = 0) -> SamplingParams:
    """What a request that sets nothing samples with: the checkpoint's generation_config, seeded."""
    d = engine.sampling_defaults
    return SamplingParams(temperature=d.temperature or 0.0, top_p=d.top_p or 1.0, top_k=d.top_k or 0,
                          min_p=d.min_p or 0.0, repetition_penalty=d.repetition_penalty or 1.0, seed=seed,
                          **({"max_tokens": max_tokens} if max_tokens else {}))


def warm_like_serve(engine: Engine, specs) -> None:
    """On a GPU, what `spruce serve` runs before its first request (engine/warmup.py): every kernel
    variant and tree shape class the methods' budgets and depths can reach, compiled before anything
    is timed. Without it a tree class first reached in a measured run compiled there: on the H200,
    rounds of a controller's request whose mean was 4x their median."""
    from engine.kernels import gpu_backend
    from engine.warmup import warm_up

    trees = [s for s in specs if s.method != "none"]
    if gpu_backend() is not None and trees:
        widest = dataclasses.replace(trees[0], budget=max(s.budget for s in trees),
                                     max_depth=max(s.max_depth for s in trees))
        print(f"warm-up as spruce serve's: {warm_up(engine, spec=widest).seconds:.1f} s")


def distinct_8grams(tokens: list[int]) -> float:
    grams = [tuple(tokens[i : i + 8]) for i in range(len(tokens) - 7)]
    return len(set(grams)) / len(grams) if grams else 1.0


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def parse_methods(text: str, budgets: list[int], depth: int, a) -> dict[str, SpecConfig]:
    specs = {}
    for item in text.split(","):
        # METHOD[:TREE][/vN][/dN]: /vN a draft vocabulary of N tokens (v0 the whole vocabulary),
        # /dN this method's tree depth (else --depth's)
        head, *options = item.split("/")
        method, _, tree = head.partition(":")
        known = {o[0]: int(o[1:]) for o in options if o[:1] in ("v", "d") and o[1:].isdigit()}
        if len(known) != len(options):
            raise SystemExit(f"unknown option in method {item!r}: /vN (draft vocabulary) and /dN (depth) are known")
        for budget in ([16] if method == "none" else budgets):
            name = method if method == "none" else f"{item}@{budget}"
            specs[name] = SpecConfig(method=method, tree=tree or "ddtree", budget=budget,
                                     max_depth=known.get("d", depth), draft_model=a.draft_model,
                                     dflash_model=a.dflash_model, adaptive=a.adaptive, draft_vocab=known.get("v"))
    return specs


def plot(histograms: dict[str, list[int]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in histograms if n != "none"]
    cols = 4
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), dpi=100, squeeze=False)
    top = max((max(h) for h in histograms.values() if h), default=1)
    for ax, name in zip(axes.flat, names):
        h = histograms[name]
        ax.hist(h, bins=range(1, top + 2), align="left", color="tab:blue", rwidth=0.85)
        mean = statistics.mean(h) if h else 0
        ax.set_title(f"{name}  (mean {mean:.2f})", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.supxlabel("tokens emitted per target forward pass (accepted drafts + bonus)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED / "target"))
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--dflash-model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budgets", default="16,32")
    ap.add_argument("--depth", type=int, default=0, help="tree depth (0: each method's default)")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--kinds", default=",".join(PROMPTS))
    ap.add_argument("--adaptive", action="store_true",
                    help="let the controller size each round's tree (engine/spec_control.py); default: every "
                         "round gets the full budget, which is what tok/fwd of a method means")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--defaults", action="store_true",
                    help="sample with the checkpoint's generation_config.json (temperature, top_p, top_k, "
                         "repetition_penalty) and --seed")
    ap.add_argument("--dtype", default="float32",
                    help="compute dtype (float32: the losslessness checks demand identity; on a GPU the "
                         "engine's own default is bfloat16)")
    ap.add_argument("--mlx-lm", action="store_true",
                    help="also time mlx-lm's plain decoding of each prompt (greedy), interleaved with the methods")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--plot-json", type=Path, help="only draw --png from a report written by --json")
    a = ap.parse_args()
    if a.png:  # before the run, not after it: --png needs the bench extra
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error('--png needs matplotlib: pip install ".[bench]"')
    if a.plot_json:
        plot(json.loads(a.plot_json.read_text())["per_round_histograms"], a.png)
        return
    engine = Engine(EngineConfig(model_path=a.model, dtype=a.dtype, spec=SpecConfig(dflash_model=a.dflash_model)))
    specs = parse_methods(a.methods, [int(b) for b in a.budgets.split(",")], a.depth, a)
    for name, spec in specs.items():
        if (why := engine.missing_drafter(spec.method, spec.tree)) is not None:
            print(f"skipping {name}: {why}")
    specs = {n: s for n, s in specs.items() if not engine.missing_drafter(s.method, s.tree)}
    warm_like_serve(engine, specs.values())
    ref_model = None
    if a.mlx_lm:
        import tempfile

        from bench_decode import mlx_lm_view
        from mlx_lm import load

        with tempfile.TemporaryDirectory() as tmp:
            ref_model, _ = load(str(mlx_lm_view(Path(a.model), Path(tmp))))
            if a.dtype == "float32":
                import mlx.core as mx

                ref_model.set_dtype(mx.float32)
    base = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    if a.defaults:
        base = checkpoint_defaults(engine, a.seed)
    decoding = "greedy" if base.temperature == 0 else \
        f"temperature {base.temperature}, top_p {base.top_p}, top_k {base.top_k}, repetition penalty " \
        f"{base.repetition_penalty}, seed {a.seed}"
    print(f"model {Path(a.model).name}, up to {a.tokens} tokens ({decoding}), depth {a.depth or 'per method'}, "
          f"{'adaptive' if a.adaptive else 'fixed'} budgets, median of {a.runs} runs")
    print(f"{'prompt':10} {'method':18} {'tok/s':>7} {'vs none':>8} {'tok/fwd':>8} {'draft%':>7} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'8-gram':>7}  same")
    report: dict = {"args": vars(a) | {"json": str(a.json), "png": str(a.png)}, "rows": []}
    histograms: dict[str, list[int]] = {n: [] for n in specs}
    # warm-up: compiles and loads the drafters. The first prompt's runs as long as the measured
    # ones, so that the tree shapes they reach are compiled before anything is timed (on the H200
    # the first prompt's rounds otherwise carried those compilations: 33-42 ms rounds, a 1.4 s p99)
    warm_tokens = a.tokens
    for kind in a.kinds.split(","):
        for p, text in enumerate(PROMPTS[kind]):
            prompt = render(engine, text)
            for spec in specs.values():
                one(engine, prompt, spec, warm_tokens, base)
            if ref_model is not None:
                mlx_lm_one(ref_model, prompt, warm_tokens)
            warm_tokens = 8
            results = {n: Result() for n in [*specs, *(["mlx-lm"] if ref_model is not None else [])]}
            for _ in range(a.runs):
                for name, spec in specs.items():
                    results[name].runs.append(one(engine, prompt, spec, a.tokens, base))
                if ref_model is not None:  # as many tokens as plain decoding emitted (it may stop early)
                    n = len(results["none"].runs[-1].tokens)
                    results["mlx-lm"].runs.append(mlx_lm_one(ref_model, prompt, n))
            plain_tps = statistics.median(r.tps for r in results["none"].runs)
            ref = results["none"].runs[0].tokens
            label = kind if len(PROMPTS[kind]) == 1 else f"{kind}{p + 1}"
            for name, res in results.items():
                runs = res.runs
                tps = statistics.median(r.tps for r in runs)
                row = {"prompt": label, "method": name, "tok_s": round(tps, 1), "vs_none": round(tps / plain_tps, 3),
                       "tok_fwd": round(statistics.median(r.tpf for r in runs), 3),
                       "draft_share": round(statistics.median(r.draft_share for r in runs), 3),
                       "verify_share": round(statistics.median(r.verify_share for r in runs), 3),
                       "commit_share": round(statistics.median(r.commit_share for r in runs), 3),
                       "ms_per_round": round(statistics.median(r.round_ms for r in runs), 3),
                       "itl_p50_ms": round(percentile([g for r in runs for g in r.gaps_ms], 0.5), 2),
                       "itl_p99_ms": round(percentile([g for r in runs for g in r.gaps_ms], 0.99), 2),
                       "distinct_8grams": round(distinct_8grams(runs[0].tokens), 3),
                       "tokens": len(runs[0].tokens),
                       # mlx-lm decodes greedily: its text is comparable to plain decoding's only then
                       "same": all(r.tokens == ref for r in runs) if name != "mlx-lm" or base.temperature == 0
                       else None}
                report["rows"].append(row)
                if name in histograms:
                    histograms[name] += runs[0].per_round
                same = "-" if row["same"] is None else "yes" if row["same"] else "NO"
                print(f"{label:10} {name:18} {row['tok_s']:7.1f} {row['vs_none']:7.2f}x {row['tok_fwd']:8.2f} "
                      f"{100 * row['draft_share']:6.1f}% {row['itl_p50_ms']:8.1f} {row['itl_p99_ms']:8.1f} "
                      f"{row['distinct_8grams']:7.2f}  {same}", flush=True)
            report["per_round_histograms"] = histograms
            if a.json:  # after every prompt: a run cut short keeps what it measured
                a.json.write_text(json.dumps(report, indent=1))
    if a.png:
        plot(histograms, a.png)
        print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
