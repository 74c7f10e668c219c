"""Write a tiny random checkpoint with HF `transformers` (the real on-disk format).

Used by tests and benchmarks: no weights can be downloaded, so every checkpoint the
loader is tested on is one that transformers itself saved.

    python scripts/make_tiny_checkpoint.py OUT_DIR [--kind qwen3_5|qwen3_5_cg|qwen3]
        [--hidden 64 --layers 4 --vocab 512 --seed 0 --dtype float32] [--mtp inline|file]
    python scripts/make_tiny_checkpoint.py OUT_DIR --kind dflash --target TARGET_DIR [--layers 2]

--mtp adds an MTP head in the real Qwen3.5 layout (`mtp.*` tensors, HF zero-centred norms)
inside model.safetensors (inline) or in a separate mtp.safetensors (file), as transformers
itself does not model it. --kind dflash writes a DFlash drafter for TARGET_DIR in z-lab's
layout (config.json with dflash_config, tensors without embedding or lm_head).
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
    model = build_model(a)
    model.save_pretrained(a.out)
    if a.mtp != "none":
        add_mtp(a.out, model.config if a.kind == "qwen3_5" else model.config.text_config, a.seed, a.mtp)
    write_tokenizer(a.out, tok, (HERE / "qwen35_chat_template.jinja").read_text())
    print(f"wrote {a.kind} checkpoint to {a.out}")


if __name__ == "__main__":
    main()
