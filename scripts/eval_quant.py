"""Quality of `spruce convert` variants: KL divergence to the unquantized model's next-token
distribution and perplexity, on held-out text.

    LD_PRELOAD=<openblas libblas.so.3> python scripts/eval_quant.py [--model DIR] [--windows 24]
        [--window 512] [--group-size 64] [--variants 8,8h,4,4h]

Variants: "8" = 8-bit, "4h" = 4-bit with the Hadamard rotation, "noneh" = rotation only (a check:
its KL must be ~0). Every variant is converted from --model (default: the bundled target) into a
temporary directory and run by Spruce in fp32, like the reference. Held-out text: the stdlib
files that scripts/build_corpus.py puts in the held-out bucket (the bundled models never trained
on them), tokenized whole and cut into windows of --window tokens; KL and loss are averaged over
every predicted token of every window.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx
import numpy as np

from engine.convert import ConvertOptions, convert
from engine.generate import BUNDLED
from engine.loader import load_model
from engine.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent


@dataclass
class Score:
    variant: str
    bytes: int
    kl: float  # mean KL(reference || variant), nats per token
    ppl: float
    top1: float  # share of positions where the argmax agrees with the reference's


def heldout_windows(tokenizer: Tokenizer, n: int, length: int) -> list[list[int]]:
    spec = importlib.util.spec_from_file_location("build_corpus", HERE / "build_corpus.py")
    assert spec is not None and spec.loader is not None
    corpus = importlib.util.module_from_spec(spec)
    sys.modules["build_corpus"] = corpus  # its dataclasses look their module up
    spec.loader.exec_module(corpus)
    sep = tokenizer.token_id("<|endoftext|>")
    ids: list[int] = []
    for rel, text in corpus.stdlib_sources(Path(sysconfig.get_paths()["stdlib"])):
        if corpus.is_heldout(rel, 3):
            ids += tokenizer.encode(text) + ([sep] if sep is not None else [])
        if len(ids) >= n * length:
            break
    return [ids[i * length:(i + 1) * length] for i in range(min(n, len(ids) // length))]


def log_probs(path: Path, windows: list[list[int]]) -> list[np.ndarray]:
    model = load_model(path, "float32").model
    out = []
    for w in windows:
        logits = model(mx.array([w]), model.make_cache())[0].astype(mx.float32)
        out.append(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
    return out


def score(variant: str, nbytes: int, ref: list[np.ndarray], got: list[np.ndarray], windows) -> Score:
    kls, nll, agree, count = 0.0, 0.0, 0, 0
    for r, g, w in zip(ref, got, windows):
        r, g = r[:-1], g[:-1]  # the last position predicts a token outside the window
        kls += float((np.exp(r) * (r - g)).sum())
        nll -= float(g[np.arange(len(w) - 1), w[1:]].sum())
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        count += len(w) - 1
    return Score(variant, nbytes, kls / count, math.exp(nll / count), agree / count)


def options_for(variant: str, group: int) -> ConvertOptions:
    hadamard = variant.endswith("h")
    bits = variant[:-1] if hadamard else variant
    return ConvertOptions(bits=None if bits == "none" else int(bits), group_size=group, hadamard=hadamard)


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=BUNDLED / "target")
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--variants", default="8,8h,4,4h")
    a = ap.parse_args()
    windows = heldout_windows(Tokenizer.from_dir(a.model), a.windows, a.window)
    ref = log_probs(a.model, windows)
    rows = [score("reference (stored dtype, fp32 compute)", weight_bytes(a.model), ref, ref, windows)]
    with tempfile.TemporaryDirectory() as tmp:
        for variant in a.variants.split(","):
            out = Path(tmp) / variant
            convert(a.model, out, options_for(variant, a.group_size), progress=False)
            rows.append(score(variant, weight_bytes(out), ref, log_probs(out, windows), windows))
    print(f"model {a.model.name}: {len(windows)} held-out windows x {a.window} tokens, group size {a.group_size}")
    print("| variant | weights MB | KL to reference (nats/token) | perplexity | top-1 agreement |")
    print("|---|---|---|---|---|")
    for s in rows:
        print(f"| {s.variant} | {s.bytes / 1e6:.2f} | {s.kl:.5f} | {s.ppl:.3f} | {s.top1 * 100:.1f} % |")


if __name__ == "__main__":
    main()
