"""Random-weight Qwen3.5 checkpoints of real shapes, for GPU benchmarks (no weights can be downloaded).

    python scripts/shaped_checkpoint.py OUT --shape 9b [--bits 4] [--group-size 64] [--readable-vocab 8192]

Written in MLX layout by mlx-lm's own model code (bf16; quantized unless --bits 0), with the
bundled model's tokenizer files. Shapes: 9b (Qwen3.5-9B), 0.8b (Qwen3.5-0.8B), bundled (the
bundled target's). Used by scripts/bench_gpu.py and scripts/profile_gpu.py; run alone, it makes
the checkpoint an HTTP benchmark (scripts/bench_peers.py) serves.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "engine" / "bundled" / "target"
SHAPES = {  # text configs of the random checkpoints (Qwen3.5 layouts)
    "9b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False),
    "0.8b": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True),
}
COMMON = dict(model_type="qwen3_5_text", linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
              max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                              "partial_rotary_factor": 0.25})


def bundled_text_config() -> dict:
    cfg = json.loads((BUNDLED / "config.json").read_text())
    cfg = dict(cfg, **cfg.get("text_config", {}))
    return {k: cfg[k] for k in SHAPES["9b"]}


def make_checkpoint(out: Path, shape: str, bits: int = 4, group_size: int = 64, readable_vocab: int = 0) -> Path:
    """A random-weight Qwen3.5 checkpoint in MLX layout, written by mlx-lm's code (bf16; quantized
    unless bits is 0). readable_vocab > 0 zeroes the output rows of the ids past it (the bundled
    tokenizer's 8192): greedy text then stays in ids a client can read, which an HTTP benchmark
    needs (an id the tokenizer lacks streams as nothing); the matmul reads the same bytes."""
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.models import qwen3_5 as mq
    from mlx_lm.utils import quantize_model, save_config, save_model

    text = dict(COMMON, **(bundled_text_config() if shape == "bundled" else SHAPES[shape]))
    config = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}
    mx.random.seed(0)
    model = mq.Model(mq.ModelArgs.from_dict(config))
    model.update(tree_map_with_path(lambda p, x: x if p.endswith("A_log") else x.astype(mx.bfloat16),
                                    model.parameters()))
    if readable_vocab:
        lm = model.language_model
        head = lm.model.embed_tokens if text["tie_word_embeddings"] else lm.lm_head
        w = head.weight
        head.weight = mx.concatenate([w[:readable_vocab], mx.zeros_like(w[readable_vocab:])])
    mx.eval(model.parameters())
    if bits:
        model, config = quantize_model(model, config, group_size, bits)
    out.mkdir(parents=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (BUNDLED / f).is_file():  # a real tokenizer; ids past its vocabulary are just never decoded
            shutil.copy(BUNDLED / f, out / f)
    n = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    print(f"   wrote {out.name}: {n / 1e9:.2f} GB of parameters")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="a directory that does not exist yet")
    ap.add_argument("--shape", choices=[*SHAPES, "bundled"], default="9b")
    ap.add_argument("--bits", type=int, default=4, help="0: keep bf16")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--readable-vocab", type=int, default=0)
    a = ap.parse_args(argv)
    if a.out.exists():
        ap.error(f"{a.out} exists")
    make_checkpoint(a.out, a.shape, a.bits, a.group_size, a.readable_vocab)


if __name__ == "__main__":
    main()
