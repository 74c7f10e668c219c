"""GPU benchmark: Spruce against mlx-lm in the same run, on checkpoints it writes itself.

    python scripts/bench_gpu.py --out DIR [--targets 9b,bundled,0.8b] [--tokens 128] [--runs 3]

On the machine with the GPU (MLX CUDA or Metal). Writes random-weight checkpoints in MLX layout
with mlx-lm's own model code (a Qwen3.5-9B-shaped 4-bit g64 target, a 0.8B-shaped 4-bit draft)
and uses the bundled model as shipped (`--targets 0.8b`: the draft's shape as a target); then prints
and writes (DIR/results.json, DIR/results.md):
- plain decode tok/s: Spruce with the GDN kernels, Spruce with the plain-ops core, mlx-lm (and any
  variant --cores names: "-mlxqmm" MLX's quantized matmul, "-kwN" N warps on long reductions,
  "-dq0" qmm_mma without paired dequantization, "-evN" a verify handed to the device every N
  layers, "-fold0" each commit run on its own instead of folded into the next verify),
  the runs interleaved (one of each setup in turn) after a warm-up of each;
- greedy tokens equal or not, and the max |logit| difference on the decode prompt (128 random ids,
  or --prompt-tokens) (parity);
- the cost of one speculation round for trees of N nodes, split into verify / accept / commit,
  as a ratio to Spruce's plain step, kernels and ops; the draft model's drafting time;
- prefill tok/s on a 4k-token prompt;
- per-layer kernel times against their plain-ops twins.
Random weights make acceptance meaningless, so the rounds are timed on fixed tree shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_decode import mlx_lm_decode, mlx_lm_view  # noqa: E402
from round_costs import chain_with_siblings, round_costs  # noqa: E402
from shaped_checkpoint import BUNDLED, make_checkpoint  # noqa: E402
from variants import variant_setting  # noqa: E402

TREE_SIZES = (1, 4, 8, 16, 17, 32)
RESULTS: dict[str, Any] = {}


def log(*a: object) -> None:
    print(*a, flush=True)


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """A part of the benchmark: a failure is printed and recorded, the rest goes on."""
    t0 = time.perf_counter()
    log(f"\n== {name}")
    try:
        yield
    except Exception:
        RESULTS.setdefault("errors", {})[name] = traceback.format_exc()
        log(traceback.format_exc())
    log(f"   ({time.perf_counter() - t0:.1f} s)")




def spruce_engine(path: Path, dtype: str, core: str) -> Any:
    """core: kernels | ops (the GDN core), with "-mlxqmm": MLX's quantized matmul instead of the
    small-M kernel (engine/models/qlinear.py); the other suffixes: scripts/variants.py."""
    from engine.config import EngineConfig
    from engine.generate import Engine

    gdn, _, matmul = core.partition("-")
    os.environ["SPRUCE_GDN_CORE"] = gdn
    if matmul == "mlxqmm":
        os.environ["SPRUCE_QMM"] = "0"
    try:
        return Engine(EngineConfig(model_path=str(path), dtype=dtype, prefix_cache=False, max_context=8192))
    finally:
        os.environ.pop("SPRUCE_GDN_CORE", None)
        os.environ.pop("SPRUCE_QMM", None)


def spruce_decode(engine: Any, prompt: list[int], n: int) -> tuple[float, list[int]]:
    from engine.config import SamplingParams
    from engine.types import GenerationRequest

    req = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(max_tokens=n, ignore_eos=True))
    tokens: list[int] = []
    t_first = 0.0
    for step in engine.generate(req):
        if not tokens and step.token_ids:
            t_first = time.perf_counter()
        tokens += step.token_ids
    return (len(tokens) - 1) / (time.perf_counter() - t_first), tokens


def median_of(fn: Callable[[], float], runs: int) -> float:
    return statistics.median(fn() for _ in range(runs))


def decode_section(name: str, path: Path, dtype: str, args: argparse.Namespace, prompt: list[int]) -> dict:
    from mlx_lm import load

    row: dict[str, Any] = {"checkpoint": name, "dtype": dtype}
    engines = {core: spruce_engine(path, dtype, core) for core in args.cores}
    ref, _ = load(str(path))
    if dtype == "float32":
        ref.set_dtype(mx.float32)
    log(f"   engines loaded ({time.perf_counter() - T0:.0f} s)")
    outs: dict[str, list[int]] = {}
    def spruce_run(core: str, e: Any) -> tuple[float, list[int]]:
        with variant_setting(core):
            return spruce_decode(e, prompt, args.tokens)

    runs_of: list[tuple[str, Callable[[], tuple[float, list[int]]]]] = [
        (f"spruce_{core}", lambda core=core, e=e: spruce_run(core, e)) for core, e in engines.items()]
    runs_of.append(("mlx_lm", lambda: mlx_lm_decode(ref, prompt, args.tokens)))
    for label, fn in runs_of:
        t_warm = time.perf_counter()
        fn()  # warm-up (compiles)
        row[f"{label}_warmup_s"] = time.perf_counter() - t_warm
    # runs interleaved (one of each setup in turn), so a machine that drifts moves all alike
    results: dict[str, list[tuple[float, list[int]]]] = {label: [] for label, _ in runs_of}
    for _ in range(args.runs):
        for label, fn in runs_of:
            results[label].append(fn())
    for label, runs in results.items():
        row[f"{label}_tok_s"] = statistics.median(r[0] for r in runs)
        row[f"{label}_runs_tok_s"] = [round(r[0], 1) for r in runs]
        outs[label] = runs[-1][1]
        log(f"   {label}: {row[f'{label}_tok_s']:.1f} tok/s {row[f'{label}_runs_tok_s']} "
            f"({time.perf_counter() - T0:.0f} s)")
    row["kernels_vs_mlx_lm"] = row["spruce_kernels_tok_s"] / row["mlx_lm_tok_s"]
    for core in engines:
        # each run against the mlx-lm run right after it: on a lease whose speed drifts by 1.5x
        # within a call, the median of these pairs moves less than the ratio of the medians
        pairs = [s[0] / m[0] for s, m in zip(results[f"spruce_{core}"], results["mlx_lm"], strict=True)]
        row[f"spruce_{core}_paired_vs_mlx_lm"] = [round(r, 3) for r in pairs]
        log(f"   spruce_{core} / mlx_lm: {row[f'spruce_{core}_tok_s'] / row['mlx_lm_tok_s']:.3f} "
            f"(run by run {row[f'spruce_{core}_paired_vs_mlx_lm']}, median {statistics.median(pairs):.3f})")
    row["greedy_equal_kernels_mlx_lm"] = _same_prefix(outs["spruce_kernels"], outs["mlx_lm"])
    if "spruce_ops" in outs:
        row["greedy_equal_kernels_ops"] = _same_prefix(outs["spruce_kernels"], outs["spruce_ops"])
    row["parity"] = parity(engines, ref, prompt)
    log(f"   parity {row['parity']} ({time.perf_counter() - T0:.0f} s)")
    row["plain_step_ms"] = 1e3 / row["spruce_kernels_tok_s"]
    row["rounds"] = {}
    for core, engine in engines.items():
        sizes = args.ops_tree_sizes if core == "ops" else args.tree_sizes
        if not sizes:
            continue
        with variant_setting(core):
            row["rounds"][core] = round_costs(engine, prompt, sizes)
        log(f"   rounds {core}: {row['rounds'][core]} ({time.perf_counter() - T0:.0f} s)")
        save(args.out, row)
    if args.prefill_tokens:
        row["prefill"] = prefill(engines["kernels"], ref, args.prefill_tokens)
        log(f"   prefill {row['prefill']} ({time.perf_counter() - T0:.0f} s)")
    return row


T0 = time.perf_counter()


def save(out: Path, partial: dict | None = None) -> None:
    """Results so far (a later section may not finish inside the machine's time)."""
    data = dict(RESULTS, partial=partial) if partial is not None else RESULTS
    (out / "results.json").write_text(json.dumps(data, indent=1))


def _same_prefix(a: list[int], b: list[int]) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{n}/{min(len(a), len(b))}"


def parity(engines: dict[str, Any], ref: Any, prompt: list[int]) -> dict[str, float]:
    """Last-position logits over the prompt: Spruce (each core) against mlx-lm, and kernels vs ops."""
    ids = mx.array([prompt])
    theirs = ref(ids)[0, -1].astype(mx.float32)
    out = {}
    ours = {}
    for core, e in engines.items():
        ours[core] = e.model(ids, e.model.make_cache())[0, -1].astype(mx.float32)
        out[f"{core}_vs_mlx_lm_max_abs"] = float(mx.abs(ours[core] - theirs).max())
    if "ops" in ours:
        out["kernels_vs_ops_max_abs"] = float(mx.abs(ours["kernels"] - ours["ops"]).max())
    out["max_abs_logit"] = float(mx.abs(theirs).max())
    out["argmax_equal"] = bool(int(mx.argmax(theirs)) == int(mx.argmax(ours["kernels"])))
    return out


def prefill(engine: Any, ref: Any, n: int) -> dict[str, float]:
    from mlx_lm.models.cache import make_prompt_cache

    from engine import forward

    ids = [int(t) for t in np.random.RandomState(1).randint(0, min(engine.vocab_size, 8000), size=n)]

    def ours() -> float:
        cache = engine.model.make_cache()
        t0 = time.perf_counter()
        forward.extend(engine.model, cache, ids, engine.prefill_chunk)
        return n / (time.perf_counter() - t0)

    def theirs() -> float:
        cache = make_prompt_cache(ref)
        t0 = time.perf_counter()
        for i in range(0, n, 2048):
            mx.eval(ref(mx.array([ids[i : i + 2048]]), cache=cache))
        return n / (time.perf_counter() - t0)

    ours()
    theirs()
    return {"tokens": n, "spruce_tok_s": median_of(ours, 3), "mlx_lm_tok_s": median_of(theirs, 3)}


def draft_section(draft: Path, prompt: list[int]) -> dict[str, float]:
    """The draft-chain drafter's time per round with the 0.8B-shaped draft (depth 8, budget 16)."""
    from engine.drafters.draft_chain import DraftChainDrafter
    from engine.loader import load_model

    drafter = DraftChainDrafter(load_model(draft, "bfloat16").model)
    drafter.begin(prompt)
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        tree = drafter.propose(prompt[-1], 16, 8)
        times.append((time.perf_counter() - t0) * 1e3)
        drafter.observe([tree.tokens[1], 7])  # one accepted draft and a bonus
    ms = statistics.median(times[2:])
    return {"draft_ms_per_round": ms, "drafted_nodes": tree.size - 1, "ms_per_chain_token": ms / 8}


def per_call_us(fn: Callable[[], Any], calls: int = 20) -> float:
    """Median µs per call, `calls` calls queued per evaluation."""
    mx.eval(fn())

    def timed() -> float:
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        return (time.perf_counter() - t0) / calls * 1e6

    return median_of(timed, 5)


def kernel_micro(shape_name: str) -> dict[str, float]:
    """Per-layer µs of the GDN core: kernels and plain ops, 9B layer shape, 20 calls per evaluation."""
    from engine.forward import tree_batch
    from engine.gdn.core import GDNShape, GDNWeights, OpsCore
    from engine.kernels import KernelCore, gpu_backend

    s = GDNShape(16, 32, 128, 128, 4) if shape_name == "9b" else GDNShape(6, 12, 32, 32, 4)
    rng = np.random.default_rng(0)

    def arr(*shape: int, dt: Any = mx.bfloat16) -> mx.array:
        return mx.array(rng.normal(size=shape).astype(np.float32)).astype(dt)

    w = GDNWeights(arr(s.conv_dim, s.K), arr(s.Hv, dt=mx.float32), arr(s.Hv))
    S = arr(s.Hv, s.Dv, s.Dk, dt=mx.float32) * 0.1
    conv = arr(s.K - 1, s.conv_dim)
    cores = {"kernels": KernelCore(gpu_backend() or "cuda"), "ops": OpsCore()}
    out: dict[str, float] = {}
    tree = chain_with_siblings(17)
    gdn = tree_batch(tree, 100, s.K).gdn
    path = mx.array(tree.path_to(8), dtype=mx.int32)
    for name, core in cores.items():
        q1, a1, b1 = arr(1, s.conv_dim), arr(1, s.Hv), arr(1, s.Hv)
        qn, an, bn = arr(17, s.conv_dim), arr(17, s.Hv), arr(17, s.Hv)
        step = mx.compile(lambda q, a, b, c, S, core=core: core.step(s, w, q, a, b, c, S))
        treef = mx.compile(lambda q, a, b, c, S, core=core: core.tree(s, w, q, a, b, c, S, gdn)[0])
        _, rows = core.tree(s, w, qn, an, bn, conv, S, gdn)
        mx.eval(rows.u, rows.k, rows.g)
        calls: dict[str, Callable[[], Any]] = {
            "step": lambda step=step, q=q1, a=a1, b=b1: step(q, a, b, conv, S),
            "tree17": lambda treef=treef, q=qn, a=an, b=bn: treef(q, a, b, conv, S),
            "commit": lambda core=core, rows=rows: core.commit(rows, path, conv, S),
        }
        for label, fn in calls.items():
            out[f"{label}_{name}_us"] = per_call_us(fn)
    return out


def markdown(r: dict) -> str:
    lines = [f"device: {r.get('device')}, mlx {r.get('mlx')}, mlx-lm {r.get('mlx_lm')}", ""]
    rows = r.get("decode", [])
    if rows:
        lines += ["| checkpoint | compute | Spruce kernels tok/s | Spruce ops tok/s | mlx-lm tok/s | kernels / mlx-lm |"
                  " greedy = mlx-lm | greedy kernels = ops | max abs logit diff vs mlx-lm (kernels, ops) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for x in rows:
            p = x["parity"]
            lines.append(f"| {x['checkpoint']} | {x['dtype']} | {x['spruce_kernels_tok_s']:.1f} | "
                         f"{x.get('spruce_ops_tok_s', float('nan')):.1f} | {x['mlx_lm_tok_s']:.1f} | "
                         f"{x['kernels_vs_mlx_lm']:.2f} | {x['greedy_equal_kernels_mlx_lm']} | "
                         f"{x.get('greedy_equal_kernels_ops', '-')} | "
                         f"{p['kernels_vs_mlx_lm_max_abs']:.4f}, {p.get('ops_vs_mlx_lm_max_abs', float('nan')):.4f} "
                         f"(max abs logit {p['max_abs_logit']:.1f}) |")
        for x in rows:  # every variant run, with its runs in the order they ran (interleaved)
            lines.append(f"\n{x['checkpoint']} {x['dtype']}: " + "; ".join(
                f"{k[:-len('_runs_tok_s')]} {x[k[:-len('_runs_tok_s')] + '_tok_s']:.1f} tok/s {v}"
                for k, v in x.items() if k.endswith("_runs_tok_s")))
            lines.append("run by run against mlx-lm's next run: " + "; ".join(
                f"{k[:-len('_paired_vs_mlx_lm')]} {v}, median {statistics.median(v):.2f}"
                for k, v in x.items() if k.endswith("_paired_vs_mlx_lm")))
        # the tree sizes measured (--tree-sizes), every one a column
        sizes = sorted({int(n) for x in rows for costs in x["rounds"].values() for n in costs}) or list(TREE_SIZES)
        lines += ["", "Speculation round (verify + accept + commit), median ms; ratio to the 1-node round:", "",
                  "| checkpoint | core | " + " | ".join(f"N={n}" for n in sizes) + " |",
                  "|---|---|" + "---|" * len(sizes)]
        for x in rows:
            for core, costs in x["rounds"].items():
                cells = [f"{c['round']:.2f} ({c['vs_1_node']:.2f}x; v {c['verify']:.2f} a {c['accept']:.2f}"
                         f" c {c['commit']:.2f})" if c else "" for c in (costs.get(str(n)) for n in sizes)]
                lines.append(f"| {x['checkpoint']} {x['dtype']} | {core} | " + " | ".join(cells) + " |")
        lines += ["", "Rounds as the engine runs them (commit queued, the next verify waits for it), median ms:"
                  " the round with its commit; without (each verify from the same state); what the commit adds"
                  " (of it, the host's part and its building); the round as a multiple of the plain step"
                  " (1 / plain tok/s); where commits fold into the next verify, the same rounds with each"
                  " commit run on its own, interleaved:", "",
                  "| checkpoint | core | " + " | ".join(f"N={n}" for n in sizes) + " |",
                  "|---|---|" + "---|" * len(sizes)]
        for x in rows:
            for core, costs in x["rounds"].items():
                cells = [f"{c['queued_round']:.2f} / {c['queued_no_commit']:.2f}; c {c['commit_queued']:.2f}"
                         f" (host {c['commit_host']:.2f}, building {c['commit_build']:.2f});"
                         f" {c['queued_round'] / x['plain_step_ms']:.2f}x"
                         + (f"; unfolded {c['queued_round_unfolded']:.2f}, c {c['commit_unfolded']:.2f}"
                            f" (host {c['commit_host_unfolded']:.2f})" if "commit_unfolded" in c else "")
                         if c and "queued_round" in c else "" for c in (costs.get(str(n)) for n in sizes)]
                lines.append(f"| {x['checkpoint']} {x['dtype']} | {core} | " + " | ".join(cells) + " |")
        lines += ["", "| checkpoint | prefill tokens | Spruce tok/s | mlx-lm tok/s |", "|---|---|---|---|"]
        for x in filter(lambda x: "prefill" in x, rows):
            p = x["prefill"]
            lines.append(f"| {x['checkpoint']} {x['dtype']} | {p['tokens']} | {p['spruce_tok_s']:.0f} | "
                         f"{p['mlx_lm_tok_s']:.0f} |")
    for key in ("draft", "kernels_9b", "kernels_bundled"):
        if key in r:
            lines += ["", f"{key}: " + ", ".join(f"{k} {v:.2f}" for k, v in r[key].items())]
    if r.get("errors"):
        lines += ["", "errors in: " + ", ".join(r["errors"])]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--targets", default="9b,bundled")
    ap.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                    help="also an existing checkpoint (e.g. scripts/widen_checkpoint.py's), decoded in bf16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=128,
                    help="random-id prompt of the decode rows (their decoding over a long context: e.g. 4096)")
    ap.add_argument("--skip-draft", action="store_true")
    ap.add_argument("--tree-sizes", type=lambda s: tuple(int(x) for x in s.split(",")), default=TREE_SIZES)
    ap.add_argument("--ops-tree-sizes", type=lambda s: tuple(int(x) for x in s.split(",") if x), default=(1, 17))
    ap.add_argument("--cores", type=lambda s: tuple(s.split(",")), default=("kernels", "ops"),
                    help="Spruce GDN cores to run (kernels first)")
    ap.add_argument("--micro", default="9b,bundled", help="layer shapes for the per-layer kernel times ('' = none)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import mlx_lm

    RESULTS.update(device=str(mx.default_device()), mlx=mx.__version__, mlx_lm=mlx_lm.__version__,
                   date=time.strftime("%Y-%m-%d"), decode=[])
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, 8000, size=args.prompt_tokens)]
    targets = [t for t in args.targets.split(",") if t]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt: dict[str, Path] = {}
        with section("checkpoints"):
            if "bundled" in targets:  # the shipped weights, or random ones of its shape when they are absent
                ckpt["bundled"] = (mlx_lm_view(BUNDLED, Path(tmp)) if (BUNDLED / "model.safetensors").is_file()
                                   else make_checkpoint(Path(tmp) / "bundled-shape", "bundled", bits=0))
            for name, path in (c.split("=", 1) for c in args.checkpoint):
                ckpt[name] = mlx_lm_view(Path(path), Path(tmp), name)
                targets += [name] if name not in targets else []
            if "9b" in targets:
                ckpt["9b"] = make_checkpoint(Path(tmp) / "qwen35-9b-shape-4bit", "9b")
            if "0.8b" in targets or ("9b" in targets and not args.skip_draft):  # a target, or the 9b's draft
                ckpt["0.8b"] = make_checkpoint(Path(tmp) / "qwen35-0.8b-shape-4bit", "0.8b")
        for name in targets:
            for dtype in (("float32", "bfloat16") if name == "bundled" else ("bfloat16",)):
                with section(f"decode {name} {dtype}"):
                    row = decode_section(name, ckpt[name], dtype, args, prompt)
                    RESULTS["decode"].append(row)
                    save(args.out)
                    log(json.dumps(row, indent=1))
                mx.clear_cache()
        if "9b" in targets and not args.skip_draft:
            with section("draft model round"):
                RESULTS["draft"] = draft_section(ckpt["0.8b"], prompt)
                save(args.out)
                log(RESULTS["draft"])
        for shape in filter(None, args.micro.split(",")):
            with section(f"kernel micro {shape}"):
                RESULTS[f"kernels_{shape}"] = kernel_micro(shape)
                log(RESULTS[f"kernels_{shape}"])
    (args.out / "results.json").write_text(json.dumps(RESULTS, indent=1))
    md = markdown(RESULTS)
    (args.out / "results.md").write_text(md)
    log("\n" + md)


if __name__ == "__main__":
    main()
