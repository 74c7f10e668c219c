"""Where a forward pass spends its time: per-layer and per-piece timings of Spruce's model at a
Qwen3.5 layer shape, for the row counts of a verify (1..32) and for a prefill chunk.

    python scripts/profile_gpu.py --out DIR [--shape 9b] [--rows 1,4,8,17,32] [--chunk 512]

The model is built in memory with the engine's own classes and random weights (4-bit affine g64,
bf16 compute for the 9B shape), with `--layers` layers (3 GDN + 1 attention by default): enough
for one layer of each kind plus the embedding and lm_head at full size. Every piece is timed as
`--calls` calls queued per evaluation (the per-launch cost shows, host syncs do not), median of 5.
On CUDA, MLX overlaps independent launches of one evaluation, so these are throughputs: a kernel
that fills few SMs looks cheaper than in a forward pass, where each launch waits for the last.
For latencies, `--ncu` marks one verify per row count for `ncu --profile-from-start off`.
Prints and writes DIR/profile.json and DIR/profile.md, including an estimate of the full model
(layers of each kind times their count) next to the measured forward of the small model.
Runs on any MLX backend; on the CPU use a small shape (--shape bundled).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from round_costs import chain_with_siblings  # noqa: E402
from shaped_checkpoint import COMMON, SHAPES, bundled_text_config  # noqa: E402
from variants import variant_setting  # noqa: E402

from engine import forward  # noqa: E402
from engine.gdn.core import GDNWeights  # noqa: E402
from engine.kernels import backend_default  # noqa: E402
from engine.models import qwen3_5  # noqa: E402
from engine.models.layers import CHAIN, attention_ops  # noqa: E402
from engine.models.qlinear import route_quantized_projections  # noqa: E402


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    """Median µs per call, `calls` calls queued per evaluation."""
    mx.eval(fn())

    def timed() -> float:
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        return (time.perf_counter() - t0) / calls * 1e6

    timed()
    return statistics.median(timed() for _ in range(5))


def build_model(shape: str, layers: int, bits: int, dtype: mx.Dtype, fuse: bool = True,
                qmm: bool = True) -> qwen3_5.Model:
    text = dict(COMMON, **(bundled_text_config() if shape == "bundled" else SHAPES[shape]))
    text["num_hidden_layers"] = layers
    model = qwen3_5.Model(qwen3_5.args_from_config(text))
    mx.random.seed(0)
    model.update(nn.utils.tree_map(lambda x: (mx.random.normal(x.shape) * 0.02).astype(dtype), model.parameters()))
    for layer in model.model.layers:  # a stable decay, norms at one
        if not layer.is_attention:
            layer.linear_attn.A_log = mx.zeros_like(layer.linear_attn.A_log).astype(mx.float32)
    if bits:
        nn.quantize(model, group_size=64, bits=bits,
                    class_predicate=lambda _, m: isinstance(m, nn.Linear | nn.Embedding))
    mx.eval(model.parameters())
    if fuse:  # as the loader does
        model.fuse_projections()
    if qmm:  # as the loader does: the engine's quantized matmul (qmm_mma on CUDA)
        route_quantized_projections(model)
    return model


def linear_pieces(prefix: str, module: nn.Module, names: tuple[str, ...], x: mx.array) -> dict[str, Callable[[], Any]]:
    """The input projections of a module: one fused matmul when the model was fused."""
    if "fused" in module:
        return {f"{prefix}.fused({'+'.join(names)})": lambda: module["fused"](x)}
    return {f"{prefix}.{n}": (lambda m=module[n]: m(x)) for n in names}


def layer_profile(model: qwen3_5.Model, cache: list, committed: int, n: int, calls: int,
                  dtype: mx.Dtype) -> dict[str, float]:
    """µs per call of each layer kind and of its pieces, for a verify of n rows (n = 1: a token)."""
    a = model.args
    tree = chain_with_siblings(n)
    batch = forward.tree_batch(tree, committed, a.linear_conv_kernel_dim)
    x = (mx.random.normal((1, n, a.hidden_size)) * 0.5).astype(dtype)
    out: dict[str, float] = {}
    gi = next(i for i, attn in enumerate(a.layer_is_attention) if not attn)
    ai = next(i for i, attn in enumerate(a.layer_is_attention) if attn)
    g_layer, a_layer = model.model.layers[gi], model.model.layers[ai]
    mlp = mx.compile(g_layer.mlp)
    pieces: dict[str, Callable[[], Any]] = {
        "gdn_layer": lambda: g_layer(x, cache[gi], batch),
        "attn_layer": lambda: a_layer(x, cache[ai], batch),
        "mlp_compiled": lambda: mlp(x),
        "input_layernorm": lambda: g_layer.input_layernorm(x),
    }
    gdn = g_layer.linear_attn
    pieces |= linear_pieces("gdn", gdn, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), x)
    pieces |= linear_pieces("mlp", g_layer.mlp, ("gate_proj", "up_proj"), x)
    mid = (mx.random.normal((1, n, a.intermediate_size)) * 0.5).astype(dtype)
    pieces["mlp.down_proj"] = lambda: g_layer.mlp.down_proj(mid)
    vo = (mx.random.normal((1, n, gdn.shape.value_dim)) * 0.5).astype(dtype)
    pieces["gdn.out_proj"] = lambda: gdn.out_proj(vo)
    s = gdn.shape
    w = GDNWeights(gdn.conv1d.weight, gdn.A_log, gdn.dt_bias)
    conv, S = cache[gi].states(dtype)
    qkv = (mx.random.normal((n, s.conv_dim)) * 0.5).astype(dtype)
    ab = (mx.random.normal((n, s.Hv)) * 0.5).astype(dtype)
    if n == 1:
        core = mx.compile(lambda q, aa, bb: model.core.step(s, w, q, aa, bb, conv, S))
    else:
        assert batch.gdn is not None
        core = mx.compile(lambda q, aa, bb: model.core.tree(s, w, q, aa, bb, conv, S, batch.gdn)[0])
    pieces["gdn.core"] = lambda: core(qkv, ab, ab)
    o = mx.random.normal((n, s.Hv, s.Dv))
    pieces["gdn.gated_norm"] = lambda: gdn.norm(o, o)
    attn = a_layer.self_attn
    pieces |= linear_pieces("attn", attn, ("q_proj", "k_proj", "v_proj"), x)
    ao = (mx.random.normal((1, n, attn.heads * attn.head_dim)) * 0.5).astype(dtype)
    pieces["attn.o_proj"] = lambda: attn.o_proj(ao)
    L = committed + n
    q = (mx.random.normal((1, attn.heads, n, attn.head_dim))).astype(dtype)
    kv = (mx.random.normal((1, attn.kv_heads, L, attn.head_dim))).astype(dtype)
    if batch.tree_mask is not None:
        tm = batch.seen_mask(L)  # built once a verify, for all its attention layers
        pieces["attn.tree_attention"] = lambda: attention_ops(q, kv, kv, attn.scale, tm)
    else:
        pieces["attn.sdpa"] = lambda: mx.fast.scaled_dot_product_attention(q, kv, kv, scale=attn.scale)
    pieces["lm_head"] = lambda: model.logits(x)
    pieces["lm_head+argmax"] = lambda: mx.argmax(model.logits(x), axis=-1)
    for name, fn in pieces.items():
        out[name] = per_call_us(fn, calls)
    return out


def forward_ms(model: qwen3_5.Model, cache: list, committed: int, n: int, runs: int = 6) -> dict[str, float]:
    """The small model's whole verify (forward + argmax on the device, one sync), split into the
    host's graph building and the evaluation, then the commit of the chain, each median ms; the
    commit is undone by a rewind so every verify starts at the same length. `queued_verify_ms`:
    ten verifies evaluated together, per verify (what the device needs when the host is ahead)."""
    tree = chain_with_siblings(n)
    path = tree.path_to(min(n - 1, 8))
    b, e, c = [], [], []
    for r in range(runs + 2):
        marks = [cc.mark() for cc in cache]
        t0 = time.perf_counter()
        choice = mx.argmax(forward.verify(model, cache, tree, committed), axis=-1)
        t1 = time.perf_counter()
        mx.eval(choice)
        t2 = time.perf_counter()
        forward.commit(cache, path)
        t3 = time.perf_counter()
        for cc, m in zip(cache, marks, strict=True):
            cc.rewind(m)
        if r >= 2:
            b.append((t1 - t0) * 1e3)
            e.append((t2 - t1) * 1e3)
            c.append((t3 - t2) * 1e3)
    queued = []
    for _ in range(3):
        t0 = time.perf_counter()
        mx.eval([mx.argmax(forward.verify(model, cache, tree, committed), axis=-1) for _ in range(10)])
        queued.append((time.perf_counter() - t0) * 1e2)
    return {"verify_ms": statistics.median(b) + statistics.median(e), "build_ms": statistics.median(b),
            "eval_ms": statistics.median(e), "commit_ms": statistics.median(c), "queued_verify_ms": min(queued)}


def ncu_capture(model: qwen3_5.Model, cache: list, committed: int, rows: list[int], fold: bool = False) -> None:
    """One verify per row count between cudaProfilerStart / Stop, for
    `ncu --profile-from-start off` (kernel names and durations of exactly these passes). With
    `fold`, each row count's verify is captured a second time right after a commit of its chain
    (up to 9 nodes), so that where the GDN caches fold commits into the next verify (the CUDA
    kernels) that verify runs the folding builds: the two passes side by side are what the fold
    costs each kernel."""
    import ctypes
    import ctypes.util

    lib = ctypes.CDLL(ctypes.util.find_library("cudart") or "libcudart.so")

    def after_commit(n: int, profiled: bool) -> None:
        tree = chain_with_siblings(n)
        marks = [c.mark() for c in cache]
        mx.eval(mx.argmax(forward.verify(model, cache, tree, committed), axis=-1))
        path = tree.path_to(min(n - 1, 8))
        forward.commit(cache, path)  # folding caches only record it: the next verify runs it
        mx.synchronize()
        if profiled:
            lib.cudaProfilerStart()
        mx.eval(mx.argmax(forward.verify(model, cache, tree, committed + len(path)), axis=-1))
        mx.synchronize()
        if profiled:
            lib.cudaProfilerStop()
        for c, m in zip(cache, marks, strict=True):
            c.rewind(m)

    for n in rows:  # warm: compiled, kernels built
        for _ in range(2):
            forward_ms(model, cache, committed, n, runs=1)
            if fold and n > 1:
                after_commit(n, profiled=False)
    for n in rows:
        tree = chain_with_siblings(n)
        mx.synchronize()
        lib.cudaProfilerStart()
        mx.eval(mx.argmax(forward.verify(model, cache, tree, committed), axis=-1))
        mx.synchronize()
        lib.cudaProfilerStop()
        if fold and n > 1:
            after_commit(n, profiled=True)


def prefill_profile(model: qwen3_5.Model, chunk: int, calls: int, dtype: mx.Dtype) -> dict[str, float]:
    """µs per call of each piece of a prefill chunk (a chain of `chunk` rows on fresh caches)."""
    a = model.args
    x = (mx.random.normal((1, chunk, a.hidden_size)) * 0.5).astype(dtype)
    gi = next(i for i, attn in enumerate(a.layer_is_attention) if not attn)
    ai = next(i for i, attn in enumerate(a.layer_is_attention) if attn)
    g_layer, a_layer = model.model.layers[gi], model.model.layers[ai]
    gdn, attn = g_layer.linear_attn, a_layer.self_attn
    s = gdn.shape
    w = GDNWeights(gdn.conv1d.weight, gdn.A_log, gdn.dt_bias)
    conv = mx.zeros((s.K - 1, s.conv_dim), dtype)
    S = mx.zeros((s.Hv, s.Dv, s.Dk), mx.float32)
    qkv = (mx.random.normal((chunk, s.conv_dim)) * 0.5).astype(dtype)
    ab = (mx.random.normal((chunk, s.Hv)) * 0.5).astype(dtype)
    q = mx.random.normal((1, attn.heads, chunk, attn.head_dim)).astype(dtype)
    kv = mx.random.normal((1, attn.kv_heads, chunk, attn.head_dim)).astype(dtype)
    pieces: dict[str, Callable[[], Any]] = {
        "gdn_layer": lambda: g_layer(x, model.make_cache()[gi], CHAIN),
        "attn_layer": lambda: a_layer(x, model.make_cache()[ai], CHAIN),
        "gdn.core_chain": lambda: model.core.chain(s, w, qkv, ab, ab, conv, S),
        **linear_pieces("gdn", gdn, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), x),
        "mlp": lambda: g_layer.mlp(x),
        "attn.sdpa_causal": lambda: mx.fast.scaled_dot_product_attention(q, kv, kv, scale=attn.scale, mask="causal"),
        "lm_head_last_row": lambda: model.logits(x[:, -1:]),
    }
    return {name: per_call_us(fn, max(1, calls // 10)) for name, fn in pieces.items()}


def markdown(r: dict) -> str:
    rows = r["rows"]
    names = list(dict.fromkeys(k for n in rows for k in r["layers"][str(n)]))
    lines = [f"device {r['device']}, mlx {r['mlx']}, shape {r['shape']} ({r['layers_built']} layers built), "
             f"{r['dtype']}, {r['bits']}-bit, {r['calls']} calls per evaluation, {r['date']}", "",
             "| piece (µs per call) | " + " | ".join(f"N={n}" for n in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for name in names:
        cells = (r["layers"][str(n)].get(name) for n in rows)
        lines.append(f"| {name} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")
    lines += ["", "| whole model | " + " | ".join(f"N={n}" for n in rows) + " |", "|---|" + "---|" * len(rows)]
    for key in ("estimate_ms", "measured_small_verify_ms", "measured_small_build_ms", "measured_small_eval_ms",
                "measured_small_queued_verify_ms", "measured_small_commit_ms"):
        lines.append(f"| {key} | " + " | ".join(f"{r[key][str(n)]:.2f}" for n in rows) + " |")
    if "prefill" in r:
        lines += ["", f"prefill chunk of {r['chunk']} rows (µs per call):", ""]
        lines += [f"- {k}: {v:.0f}" for k, v in r["prefill"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="9b", choices=("9b", "0.8b", "bundled"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bits", type=int, default=4, help="0 = unquantized")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 17, 32])
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk rows (0 = skip)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--no-fuse", action="store_true", help="keep the same-input projections separate")
    ap.add_argument("--no-qmm", action="store_true", help="MLX's quantized matmul, not the small-M kernel")
    ap.add_argument("--ncu", action="store_true", help="only mark one verify per row count for ncu")
    ap.add_argument("--ncu-fold", action="store_true",
                    help="with --ncu: also mark each tree's verify after a commit (the folding kernels)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="context the profiled passes attend to")
    ap.add_argument("--variant", default="", help="engine settings as scripts/variants.py's suffixes, e.g. -ks8-ak1")
    ap.add_argument("--full-layers", type=int, default=0, help="layers of the full model (default: the shape's)")
    args = ap.parse_args()
    with variant_setting("profile" + args.variant):
        profile(args)


def profile(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(mx, args.dtype)
    t0 = time.perf_counter()
    model = build_model(args.shape, args.layers, args.bits, dtype, not args.no_fuse,
                        not args.no_qmm and backend_default("SPRUCE_QMM"))
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    full = args.full_layers or (bundled_text_config() if args.shape == "bundled" else SHAPES[args.shape])[
        "num_hidden_layers"]
    n_attn = full // 4
    cache = model.make_cache()
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, 8000, size=args.prompt_tokens)]
    forward.extend(model, cache, prompt)
    r: dict[str, Any] = dict(device=str(mx.default_device()), mlx=mx.__version__, shape=args.shape,
                             fused=not args.no_fuse,
                             layers_built=args.layers, dtype=args.dtype, bits=args.bits, calls=args.calls,
                             date=time.strftime("%Y-%m-%d"), rows=args.rows, layers={}, estimate_ms={})
    if args.ncu:
        ncu_capture(model, cache, len(prompt), args.rows, args.ncu_fold)
        return
    for n in args.rows:
        prof = layer_profile(model, cache, len(prompt), n, args.calls, dtype)
        r["layers"][str(n)] = prof
        r["estimate_ms"][str(n)] = ((full - n_attn) * prof["gdn_layer"] + n_attn * prof["attn_layer"]
                                    + prof["lm_head+argmax"]) / 1e3
        f = forward_ms(model, cache, len(prompt), n)
        for key in ("verify_ms", "build_ms", "eval_ms", "queued_verify_ms", "commit_ms"):
            r.setdefault(f"measured_small_{key}", {})[str(n)] = f[key]
        print(f"N={n}: {json.dumps(prof)} {f}", flush=True)
        (args.out / "profile.json").write_text(json.dumps(r, indent=1))
    if args.chunk:
        r["chunk"] = args.chunk
        r["prefill"] = prefill_profile(model, args.chunk, args.calls, dtype)
        print(f"prefill: {r['prefill']}", flush=True)
    (args.out / "profile.json").write_text(json.dumps(r, indent=1))
    md = markdown(r)
    (args.out / "profile.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
