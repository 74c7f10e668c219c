"""The attention kernel of decode and verify rows (engine/attention_rows.py, metal/attn_rows.kernel)
by its chunk size: µs a call at a 9B-shaped attention layer over contexts of several lengths.

    python scripts/bench_attention_rows.py --out DIR [--lengths 128,1024,4096,16384] [--rows 1,17]
        [--chunks 8,16,32,64] [--keys 1,4] [--calls 40] [--runs 7]

Each setting builds `--calls` calls (each on its own query, so none is merged with another) and
times their one evaluation (the host encoding the launches while the device runs them), the median
over `--runs` of that time a call; the chunks' sizes alternate run by run. A kernel shorter than the
host's encoding of a launch (a few µs) reads as that encoding. A call is the kernel plus its merge
where the context takes more than one chunk. Why: a 9B-shaped decode step under ncu spent 37.5 µs a
layer in attn_rows over ~130 keys (H100, BENCHMARKS.md, issue 13, forty-seventh session), where its
0.5 MB of keys and values take well under a microsecond to read: each SIMD group walks its chunk's
keys one after another, a load, a SIMD sum and two exponentials a key. Smaller chunks put more
groups side by side and shorten each group's walk; the merge then joins more of them. `--keys`: keys
a group loads together before their softmax updates (engine.attention_rows.ATTN_KEYS; 1 = one key
after another, the kernel before the forty-eighth session). Every setting computes a row the same
way in a decode step and a verify, so the choice does not touch losslessness; each setting's
result is checked against the attention in ops (engine.models.layers.attention_ops).
Writes DIR/attention_rows.json. CUDA (or Metal) only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402

from engine.attention_rows import attention_rows  # noqa: E402
from engine.kernels import gpu_backend  # noqa: E402
from engine.models.layers import attention_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 256  # Qwen3.5-9B's attention layers


def chain_mask(n: int) -> mx.array:
    """A chain of n tree rows: row i sees rows 0..i (the densest tree of n rows)."""
    return mx.arange(n)[None, :] <= mx.arange(n)[:, None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", default="128,1024,4096,16384")
    ap.add_argument("--rows", default="1,17")
    ap.add_argument("--chunks", default="8,16,32,64")
    ap.add_argument("--keys", default="1,4", help="keys loaded together (KB)")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    if gpu_backend() is None:
        sys.exit("bench_attention_rows: the kernel runs on a GPU backend (CUDA or Metal)")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = [(int(c), int(k)) for c in args.chunks.split(",") for k in args.keys.split(",")]
    result: dict = dict(device=str(mx.default_device()), mlx=mx.__version__, date=time.strftime("%Y-%m-%d"),
                        heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, cells=[])
    print("| keys | rows | " + " | ".join(f"chunk {c} KB {k} µs" for c, k in settings) + " | max abs diff vs ops |")
    print("|---|---|" + "---|" * len(settings) + "---|")
    for length in (int(x) for x in args.lengths.split(",")):
        for n in (int(x) for x in args.rows.split(",")):
            keys_ = mx.random.split(mx.random.key(length * 100 + n), 3)
            keys = mx.random.normal((1, KV_HEADS, length, HEAD_DIM), key=keys_[0]).astype(mx.bfloat16)
            values = mx.random.normal((1, KV_HEADS, length, HEAD_DIM), key=keys_[1]).astype(mx.bfloat16)
            qs = [mx.random.normal((1, HEADS, n, HEAD_DIM), key=k).astype(mx.bfloat16)
                  for k in mx.random.split(keys_[2], args.calls)]
            mask = None if n == 1 else chain_mask(n)
            mx.eval(keys, values, *qs, *([] if mask is None else [mask]))
            seen = None if mask is None else mx.concatenate(
                [mx.ones((n, length - n), dtype=mx.bool_), mask], axis=1)
            want = attention_ops(qs[0], keys, values, HEAD_DIM ** -0.5, seen).transpose(0, 2, 1, 3)[0]
            times: dict[str, list[float]] = {f"{c}/{k}": [] for c, k in settings}
            diff = 0.0
            for r in range(args.runs + 1):
                for c, k in settings:
                    outs = [attention_rows(q, keys, values, mask, chunk=c, keys_batch=k) for q in qs]
                    mx.synchronize()
                    t0 = time.perf_counter()  # the evaluation only: encoding and the device
                    mx.eval(*outs)
                    if r:  # the first run compiles each chunk size's kernels
                        times[f"{c}/{k}"].append((time.perf_counter() - t0) / args.calls * 1e6)
                    else:
                        got = outs[0].astype(mx.float32)
                        diff = max(diff, float(mx.abs(got - want.astype(mx.float32)).max()))
            cell = dict(keys=length, rows=n, us={s: statistics.median(t) for s, t in times.items()}, max_diff=diff)
            result["cells"].append(cell)
            print(f"| {length} | {n} | " + " | ".join(f"{v:.1f}" for v in cell["us"].values()) + f" | {diff:.4f} |",
                  flush=True)
            (args.out / "attention_rows.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
