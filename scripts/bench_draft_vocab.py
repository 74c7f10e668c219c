"""What a drafted depth's lm_head pass costs with a reduced draft vocabulary
(engine/drafters/draft_vocab.py): the MTP read of one depth (one row through the output projection,
its top-k and argmax, `engine.drafters.mtp_steps.read_depth`, compiled as the drafter runs it) and
DFlash's block (15 rows and their top-k), over the whole vocabulary and over its first N rows.

Random weights of a real shape (the ranking is random too: only the row count matters here):

    python scripts/bench_draft_vocab.py --shape 9b [--sizes 0,65536,32768,16384] [--runs 50]
    python scripts/bench_draft_vocab.py --shape bundled      # fp32 8192 x 384, as the bundled target on the CPU

Each call is evaluated and synchronised alone (a depth's stop rule reads it on the host); on the CPU
64 MB are streamed between calls, as the target's verify evicts the lm_head between two depths.
Medians in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from engine.drafters.draft_vocab import DraftVocab, sub_logits  # noqa: E402
from engine.drafters.marginals import top_k_logp  # noqa: E402
from engine.drafters.mtp_steps import read_depth  # noqa: E402
from engine.kernels import gpu_backend  # noqa: E402
from engine.models.qlinear import RowsQuantizedLinear  # noqa: E402

# (vocab, hidden, bits; 0 = float), compute dtype
SHAPES = {"9b": (248320, 4096, 4, mx.bfloat16), "0.8b": (248320, 1024, 4, mx.bfloat16),
          "bundled": (8192, 384, 0, mx.float32)}


class Target:
    """The part of a CausalLM a drafter's lm_head pass uses: args and an untied lm_head."""

    def __init__(self, vocab: int, hidden: int, bits: int, dtype: mx.Dtype) -> None:
        self.args = SimpleNamespace(tie_word_embeddings=False, vocab_size=vocab, hidden_size=hidden)
        linear = nn.Linear(hidden, vocab, bias=False)
        linear.weight = (mx.random.normal((vocab, hidden)) * hidden**-0.5).astype(dtype)
        self.lm_head = RowsQuantizedLinear.of(linear.to_quantized(group_size=64, bits=bits)) if bits else linear
        mx.eval(self.lm_head.parameters())

    def logits(self, h: mx.array) -> mx.array:
        return self.lm_head(h)


def timed(fn, x: mx.array, runs: int, evict: mx.array | None) -> float:
    times = []
    for i in range(runs + 3):
        if evict is not None:
            mx.eval(evict.sum())
        t = time.perf_counter()
        mx.eval(fn(x))
        if i >= 3:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="9b")
    ap.add_argument("--sizes", default=None, help="draft vocabulary sizes, 0 = the whole vocabulary")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--top-k", type=int, default=16)
    a = ap.parse_args()
    V, H, bits, dtype = SHAPES[a.shape]
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else ([0, 65536, 32768, 16384] if V > 100_000
                                                                   else [0, 4096, 2048, 1024])
    mx.random.seed(0)
    target = Target(V, H, bits, dtype)
    gpu = gpu_backend()
    evict = None if gpu else mx.random.normal((4096, 4096))  # 64 MB
    print(f"{a.shape}: lm_head {V} x {H}, {f'{bits}-bit g64' if bits else 'float'}, {dtype}, "
          f"backend {gpu or 'cpu'}, medians of {a.runs}")
    print(f"{'draft vocab':>12} {'MTP depth ms':>13} {'DFlash 15 rows ms':>18}")
    base = None
    for n in sizes:
        vocab = None if n == 0 else DraftVocab(mx.random.permutation(V)[:n].astype(mx.int32))
        logits = target.logits if vocab is None else sub_logits(target, vocab)  # type: ignore[arg-type]
        ids = None if vocab is None else vocab.ids
        depth = mx.compile(lambda y, logits=logits, ids=ids: read_depth(logits, y, a.top_k, ids))
        block = mx.compile(lambda h, logits=logits: top_k_logp(logits(h), a.top_k))
        y = mx.random.normal((1, 1, H)).astype(dtype)
        h = mx.random.normal((15, H)).astype(dtype)
        one = timed(depth, y, a.runs, evict)
        many = timed(block, h, a.runs, evict)
        base = base or (one, many)
        print(f"{n or V:>12} {one:>9.3f} ({one / base[0]:.2f}x) {many:>11.3f} ({many / base[1]:.2f}x)")


if __name__ == "__main__":
    main()
