"""Plain decoding speed: Spruce's loop vs mlx-lm's generate_step on the same checkpoint, one run.

    LD_PRELOAD=<openblas libblas.so.3> python scripts/bench_decode.py [--model DIR] [--tokens 256] [--runs 5]

Without --model it writes the 150M random "mid" checkpoint (scripts/make_tiny_checkpoint.py
--preset mid) to a temp dir. Both engines decode greedily from the same 128-token prompt; runs
alternate between the engines and the medians are compared. Prints decode tok/s and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def spruce_decode(engine, prompt: list[int], n: int) -> tuple[float, list[int]]:
    from engine.config import SamplingParams
    from engine.types import GenerationRequest

    req = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(max_tokens=n, ignore_eos=True))
    tokens, t_first = [], None
    for step in engine.generate(req):
        if t_first is None and step.token_ids:
            t_first = time.perf_counter()
        tokens += step.token_ids
    return (len(tokens) - 1) / (time.perf_counter() - t_first), tokens


def mlx_lm_timed(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """mlx-lm's plain decoding (generate_step, greedy) of up to n tokens -> (the tokens, the
    perf_counter time each reached the caller)."""
    from mlx_lm.generate import generate_step

    tokens, times = [], []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        times.append(time.perf_counter())
        tokens.append(int(tok))
    return tokens, times


def mlx_lm_decode(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """-> (decode tok/s after the first token, the tokens)."""
    tokens, times = mlx_lm_timed(model, prompt, n)
    return (len(tokens) - 1) / (times[-1] - times[0]), tokens


def mlx_lm_view(path: Path, tmp: Path, name: str = "mlx_lm_view") -> Path:
    """The checkpoint as mlx-lm loads it: links to its files (a widened 9B is 17 GB: no copy), and
    a config whose model_type is qwen3_5 (HF's causal-LM save says qwen3_5_text)."""
    view = tmp / name
    view.mkdir()
    for f in Path(path).iterdir():
        if f.name != "config.json":
            (view / f.name).symlink_to(f.resolve())
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("model_type") == "qwen3_5_text":
        cfg["model_type"] = "qwen3_5"
    (view / "config.json").write_text(json.dumps(cfg))
    return view


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    from mlx_lm import load

    from engine.config import EngineConfig
    from engine.generate import Engine

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = a.model
        if path is None:
            import make_tiny_checkpoint

            path = tmp / "mid"
            make_tiny_checkpoint.main([str(path), "--preset", "mid"])
        engine = Engine(EngineConfig(model_path=str(path)))
        ref_model, _ = load(str(mlx_lm_view(path, tmp)))
        ref_model.set_dtype(mx.float32)  # Spruce computes in fp32 on CPU whatever the file stores
        vocab = engine.vocab_size
        prompt = [int(t) for t in np.random.RandomState(0).randint(0, vocab, size=128)]
        ours, theirs = [], []
        spruce_decode(engine, prompt, 16)  # warm-up both
        mlx_lm_decode(ref_model, prompt, 16)
        for _ in range(a.runs):
            tps, t_ours = spruce_decode(engine, prompt, a.tokens)
            ours.append(tps)
            tps, t_ref = mlx_lm_decode(ref_model, prompt, a.tokens)
            theirs.append(tps)
        same = sum(x == y for x, y in zip(t_ours, t_ref))
        o, t = statistics.median(ours), statistics.median(theirs)
        print(f"model: {path.name}, {a.tokens} tokens x {a.runs} runs (medians)")
        print(f"spruce  decode: {o:8.1f} tok/s   runs: {', '.join(f'{x:.1f}' for x in ours)}")
        print(f"mlx-lm  decode: {t:8.1f} tok/s   runs: {', '.join(f'{x:.1f}' for x in theirs)}")
        print(f"ratio spruce / mlx-lm: {o / t:.2f}")
        print(f"greedy tokens identical: {same}/{min(len(t_ours), len(t_ref))}")


if __name__ == "__main__":
    main()
