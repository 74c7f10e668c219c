"""Write a tiny random checkpoint in HF's on-disk format (config.json + model.safetensors).

Used by tests and benchmarks: no weights can be downloaded. Two writers make the same files (names,
shapes, config keys) from different random numbers:
- `--backend numpy` (the default): NumPy and safetensors only, so the test suite needs no torch;
  the parity tests (tests/engine/test_parity.py) load its output with transformers, which checks
  that the format is the real one;
- `--backend transformers`: the model built and saved by HF transformers itself (needs torch).

    python scripts/make_tiny_checkpoint.py OUT_DIR [--kind qwen3_5|qwen3_5_cg|qwen3]
        [--hidden 64 --layers 4 --vocab 512 --seed 0 --dtype float32] [--backend numpy|transformers]
        [--mtp inline|file]
    python scripts/make_tiny_checkpoint.py OUT_DIR --kind dflash --target TARGET_DIR [--layers 2]

--mtp adds an MTP head in the real Qwen3.5 layout (`mtp.*` tensors, HF zero-centred norms)
inside model.safetensors (inline) or in a separate mtp.safetensors (file), as transformers
itself does not model it (needs torch and transformers, either backend). --kind dflash writes a
DFlash drafter for TARGET_DIR in z-lab's layout (config.json with dflash_config, tensors without
embedding or lm_head; needs torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|MASK|>",
]
# Tokens the Qwen format treats as ordinary text (a detokenizer must show them).
NON_SPECIAL = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}


def train_tokenizer(vocab_size: int, files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    return tok


def stdlib_files(n: int) -> list[Path]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size < 60_000)
    return files[:n]


def write_tokenizer(out: Path, tok, template: str) -> None:
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["content"] not in NON_SPECIAL
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False))


def text_config_kwargs(a) -> dict:
    heads = a.heads or max(2, a.hidden // 32)
    return dict(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate or a.hidden * 3,
        num_hidden_layers=a.layers, num_attention_heads=heads, num_key_value_heads=a.kv_heads or max(1, heads // 2),
        head_dim=a.head_dim, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=a.tied,
    )


def layer_is_attention(a, i: int) -> bool:
    return a.kind == "qwen3" or (i + 1) % a.full_every == 0


def text_config(a) -> dict:
    """The text config as transformers writes it (Qwen3_5TextConfig / Qwen3Config)."""
    kw = text_config_kwargs(a)
    types = ["full_attention" if layer_is_attention(a, i) else "linear_attention" for i in range(a.layers)]
    cfg = {**kw, "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
           "hidden_act": "silu", "initializer_range": 0.02, "layer_types": types, "pad_token_id": None,
           "use_cache": True}
    if a.kind == "qwen3":
        return {**cfg, "model_type": "qwen3", "max_window_layers": 28, "sliding_window": None,
                "use_sliding_window": False, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    return {**cfg, "model_type": "qwen3_5_text", "linear_conv_kernel_dim": 4, "linear_key_head_dim": a.linear_dim,
            "linear_num_key_heads": a.linear_k_heads, "linear_num_value_heads": a.linear_v_heads,
            "linear_value_head_dim": a.linear_dim,
            "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 1e7, "rope_type": "default"}}


# A vision tower far smaller than Qwen3.5's (which the loader skips anyway), that transformers loads.
VISION = {"depth": 1, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 16, "in_channels": 3,
          "initializer_range": 0.02, "intermediate_size": 32, "model_type": "qwen3_5_vision", "num_heads": 2,
          "num_position_embeddings": 16, "patch_size": 4, "rope_parameters": {"rope_theta": 10000.0,
                                                                              "rope_type": "axial"},
          "spatial_merge_size": 2, "temporal_patch_size": 2}


def numpy_shapes(a) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, as transformers names them (model.* for CausalLM, model.language_model.*
    and model.visual.* for ConditionalGeneration)."""
    kw = text_config_kwargs(a)
    H, I, V = kw["hidden_size"], kw["intermediate_size"], kw["vocab_size"]
    nh, kv, hd = kw["num_attention_heads"], kw["num_key_value_heads"], kw["head_dim"]
    hk, hv, d = a.linear_k_heads, a.linear_v_heads, a.linear_dim
    base = "model.language_model" if a.kind == "qwen3_5_cg" else "model"
    shapes: dict[str, tuple[int, ...]] = {f"{base}.embed_tokens.weight": (V, H), f"{base}.norm.weight": (H,)}
    if not a.tied:
        shapes["lm_head.weight"] = (V, H)
    for i in range(a.layers):
        L = f"{base}.layers.{i}"
        shapes.update({f"{L}.input_layernorm.weight": (H,), f"{L}.post_attention_layernorm.weight": (H,),
                       f"{L}.mlp.gate_proj.weight": (I, H), f"{L}.mlp.up_proj.weight": (I, H),
                       f"{L}.mlp.down_proj.weight": (H, I)})
        if layer_is_attention(a, i):
            q = nh * hd * (1 if a.kind == "qwen3" else 2)  # Qwen3.5 interleaves an output gate per head
            shapes.update({f"{L}.self_attn.q_proj.weight": (q, H), f"{L}.self_attn.k_proj.weight": (kv * hd, H),
                           f"{L}.self_attn.v_proj.weight": (kv * hd, H), f"{L}.self_attn.o_proj.weight": (H, nh * hd),
                           f"{L}.self_attn.q_norm.weight": (hd,), f"{L}.self_attn.k_norm.weight": (hd,)})
        else:
            conv = 2 * hk * d + hv * d
            shapes.update({f"{L}.linear_attn.A_log": (hv,), f"{L}.linear_attn.dt_bias": (hv,),
                           f"{L}.linear_attn.conv1d.weight": (conv, 1, 4),
                           f"{L}.linear_attn.in_proj_qkv.weight": (conv, H),
                           f"{L}.linear_attn.in_proj_z.weight": (hv * d, H),
                           f"{L}.linear_attn.in_proj_a.weight": (hv, H), f"{L}.linear_attn.in_proj_b.weight": (hv, H),
                           f"{L}.linear_attn.norm.weight": (d,), f"{L}.linear_attn.out_proj.weight": (H, hv * d)})
    if a.kind == "qwen3_5_cg":
        shapes.update(vision_shapes(H))
    return shapes


def vision_shapes(out_hidden: int) -> dict[str, tuple[int, ...]]:
    h, i, m = VISION["hidden_size"], VISION["intermediate_size"], VISION["spatial_merge_size"]
    merged = h * m * m
    out: dict[str, tuple[int, ...]] = {
        "model.visual.patch_embed.proj.weight": (h, VISION["in_channels"], VISION["temporal_patch_size"],
                                                 VISION["patch_size"], VISION["patch_size"]),
        "model.visual.patch_embed.proj.bias": (h,),
        "model.visual.pos_embed.weight": (VISION["num_position_embeddings"], h),
        "model.visual.merger.norm.weight": (h,), "model.visual.merger.norm.bias": (h,),
        "model.visual.merger.linear_fc1.weight": (merged, merged), "model.visual.merger.linear_fc1.bias": (merged,),
        "model.visual.merger.linear_fc2.weight": (out_hidden, merged),
        "model.visual.merger.linear_fc2.bias": (out_hidden,),
    }
    for b in range(VISION["depth"]):
        B = f"model.visual.blocks.{b}"
        out.update({f"{B}.attn.qkv.weight": (3 * h, h), f"{B}.attn.qkv.bias": (3 * h,),
                    f"{B}.attn.proj.weight": (h, h), f"{B}.attn.proj.bias": (h,),
                    f"{B}.mlp.linear_fc1.weight": (i, h), f"{B}.mlp.linear_fc1.bias": (i,),
                    f"{B}.mlp.linear_fc2.weight": (h, i), f"{B}.mlp.linear_fc2.bias": (h,),
                    f"{B}.norm1.weight": (h,), f"{B}.norm1.bias": (h,), f"{B}.norm2.weight": (h,),
                    f"{B}.norm2.bias": (h,)})
    return out


def random_tensor(name: str, shape: tuple[int, ...], rng):
    """float64 values drawn as randomize() below draws them (zero-centred norms randomised, so the
    +1 conversion is tested)."""
    import numpy as np

    if name.startswith("model.visual."):
        return rng.standard_normal(shape) * 0.02
    if name.endswith("norm.weight") and "linear_attn.norm" not in name:
        return rng.standard_normal(shape) * 0.1
    if "linear_attn.norm.weight" in name or name.endswith("dt_bias"):
        return 1.0 + rng.standard_normal(shape) * 0.1
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.5, 8.0, shape))
    return rng.standard_normal(shape) * 0.05


def write_numpy(a, out: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    if a.dtype not in ("float32", "float16"):
        sys.exit(f"--backend numpy writes float32 or float16, not {a.dtype} (use --backend transformers)")
    rng = np.random.default_rng(a.seed)
    tensors = {name: random_tensor(name, shape, rng).astype(a.dtype) for name, shape in numpy_shapes(a).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = text_config(a)
    if a.kind == "qwen3_5_cg":
        config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "dtype": a.dtype, "image_token_id": 248056,
                  "model_type": "qwen3_5", "text_config": {**text, "tie_word_embeddings": a.tied},
                  "tie_word_embeddings": a.tied, "video_token_id": 248057,
                  "vision_config": {**VISION, "out_hidden_size": text["hidden_size"]},
                  "vision_end_token_id": 248054, "vision_start_token_id": 248053}
    else:
        arch = "Qwen3ForCausalLM" if a.kind == "qwen3" else "Qwen3_5ForCausalLM"
        config = {"architectures": [arch], "dtype": a.dtype, **text}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True, "use_cache": True}, indent=2))


def build_model(a):
    import torch
    import transformers as tf

    torch.manual_seed(a.seed)
    kw = text_config_kwargs(a)
    if a.kind == "qwen3":
        cfg = tf.Qwen3Config(**kw, rope_theta=10000.0)
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        kw.update(
            linear_num_key_heads=a.linear_k_heads, linear_num_value_heads=a.linear_v_heads,
            linear_key_head_dim=a.linear_dim, linear_value_head_dim=a.linear_dim, linear_conv_kernel_dim=4,
            full_attention_interval=a.full_every,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        )
        text = tf.Qwen3_5TextConfig(**kw)
        if a.kind == "qwen3_5":
            model = tf.Qwen3_5ForCausalLM(text)
        else:
            cfg = tf.Qwen3_5Config(text_config=text.to_dict(), tie_word_embeddings=a.tied)
            model = tf.Qwen3_5ForConditionalGeneration(cfg)
    randomize(model, a.seed)
    return model.to(getattr(torch, a.dtype)).eval()


def randomize(model, seed: int) -> None:
    """HF inits zero-centred norms to 0; randomise them so the +1 conversion is tested."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn.norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "linear_attn.norm.weight" in name or name.endswith("dt_bias"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8.0, generator=g)))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def draft_heads():
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import draft_heads

    return draft_heads


def randomize_head(module, seed: int, zero_centred: bool) -> None:
    """Random matrices and norms (around 0 when stored zero-centred, around 1 otherwise)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if zero_centred else 1.0) + torch.randn(p.shape, generator=g) * 0.1)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def add_mtp(out: Path, text_config, seed: int, where: str) -> None:
    """Write an MTP head for the model as `mtp.*` tensors, in model.safetensors or mtp.safetensors."""
    from safetensors.torch import load_file, save_file

    head = draft_heads().MTP(text_config)
    randomize_head(head, seed + 11, zero_centred=True)
    tensors = {f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items() if "rotary" not in k}
    if where == "file":
        save_file(tensors, out / "mtp.safetensors", metadata={"format": "pt"})
    else:
        main_file = out / "model.safetensors"
        save_file({**load_file(main_file), **tensors}, main_file, metadata={"format": "pt"})


def add_mtp_to(checkpoint: Path, seed: int, where: str) -> None:
    """add_mtp for a checkpoint already on disk."""
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(checkpoint)
    add_mtp(checkpoint, getattr(cfg, "text_config", cfg), seed, where)


def make_dflash(out: Path, target: Path, layers: int, seed: int, block_size: int = 16) -> None:
    """A random DFlash drafter for the checkpoint at `target`, as z-lab publishes them."""
    import torch
    from safetensors.torch import save_file

    heads = draft_heads()
    cfg = json.loads((target / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}
    tok = json.loads((target / "tokenizer.json").read_text())
    mask = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|MASK|>")
    n = cfg["num_hidden_layers"]
    shape = heads.DFlashShape(hidden=cfg["hidden_size"], layers=layers, heads=4, kv_heads=2, head_dim=16,
                              intermediate=2 * cfg["hidden_size"],
                              target_layer_ids=(1, n - 2) if n >= 4 else (0,))
    torch.manual_seed(seed)
    model = heads.DFlash(shape)
    randomize_head(model, seed, zero_centred=False)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.hf_config(cfg["vocab_size"], mask, block_size, n), indent=1))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors",
              metadata={"format": "pt"})


def make_weaver(out: Path, target: Path, seed: int, pool: int = 16) -> None:
    """A random Weaver adapter for the checkpoint at `target`: written as the published .pth, then
    converted by scripts/convert_weaver.py into OUT (config.json, model.safetensors)."""
    import torch

    heads = draft_heads()
    cfg = json.loads((target / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}
    H = cfg["hidden_size"]
    shape = heads.WeaverShape(d_model=H, d_embed=H, d_rank=32, num_layers=2, num_heads=2, mlp_dim=64, K=15,
                              candidate_pool_size=pool)
    torch.manual_seed(seed)
    weaver = heads.Weaver(shape)
    randomize_head(weaver, seed, zero_centred=False)
    out.mkdir(parents=True, exist_ok=True)
    pth = out / "weaver.pth"
    torch.save({"config": shape.config(), "state_dict": weaver.state_dict()}, pth)
    sys.path.insert(0, str(HERE))
    import convert_weaver

    convert_weaver.main([str(pth), str(out), "--dtype", "float32"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--kind", choices=["qwen3_5", "qwen3_5_cg", "qwen3", "dflash"], default="qwen3_5")
    ap.add_argument("--mtp", choices=["none", "inline", "file"], default="none")
    ap.add_argument("--target", type=Path, help="--kind dflash: the target checkpoint it drafts for")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--full-every", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokenizer-files", type=int, default=60)
    ap.add_argument("--heads", type=int, default=0, help="attention heads (default hidden/32)")
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=0, help="MLP width (default 3 x hidden)")
    ap.add_argument("--linear-k-heads", type=int, default=2)
    ap.add_argument("--linear-v-heads", type=int, default=4)
    ap.add_argument("--linear-dim", type=int, default=16)
    ap.add_argument("--preset", choices=["mid"], help="mid: the decode benchmark's 150M model")
    ap.add_argument("--backend", choices=["numpy", "transformers"], default="numpy",
                    help="numpy (default: no torch needed) or transformers (HF builds and saves the model)")
    a = ap.parse_args(argv)
    if a.preset == "mid":  # hidden 1024, 8 layers (6 GDN + 2 attention), vocab 8192: ~150M params
        a.hidden, a.layers, a.vocab, a.heads, a.kv_heads, a.head_dim = 1024, 8, 8192, 8, 2, 128
        a.intermediate, a.linear_k_heads, a.linear_v_heads, a.linear_dim = 3072, 8, 16, 128
    if a.kind == "dflash":
        if a.target is None:
            sys.exit("--kind dflash needs --target DIR")
        make_dflash(a.out, a.target, a.layers, a.seed)
        print(f"wrote dflash checkpoint to {a.out}")
        return
    a.out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(a.vocab, stdlib_files(a.tokenizer_files))
    if tok.get_vocab_size() > a.vocab:
        sys.exit(f"tokenizer has {tok.get_vocab_size()} tokens, more than --vocab {a.vocab}")
    if a.backend == "numpy":
        write_numpy(a, a.out)
    else:
        build_model(a).save_pretrained(a.out)
    if a.mtp != "none":
        add_mtp_to(a.out, a.seed, a.mtp)
    write_tokenizer(a.out, tok, (HERE / "qwen35_chat_template.jinja").read_text())
    print(f"wrote {a.kind} checkpoint to {a.out}")


if __name__ == "__main__":
    main()
