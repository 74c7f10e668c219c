"""Train the bundled target or draft model (HF Qwen3.5 in PyTorch) on the encoded corpus.

Runs on a CUDA GPU (bf16 autocast) or, slowly, on CPU. Reproducible from --seed: init,
data order and the schedule are all seeded; --max-seconds only guards the wall clock.
Writes an HF checkpoint in bf16 (tokenizer files copied from --tokenizer), train_log.jsonl
(one line per logged step / eval) and summary.json. With --fim-weight w the FIM middle tokens
(train_fim_spans.npy from encode_corpus.py) count w times in the train loss: they are ~2 % of
the tokens but the only ones that teach infilling. Held-out losses are always unweighted.

    python scripts/train_bundled.py --model target --data build/bundled_data \
        --tokenizer engine/bundled/target --out OUT_DIR [--steps 2000 --batch 32 --seq 1024]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers as tf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HELDOUT_KINDS = ("file", "chat", "fim")


@dataclass(frozen=True)
class Arch:
    """The Qwen3.5 text-model shape of one bundled model."""

    hidden: int
    layers: int
    intermediate: int
    full_attention_interval: int  # layer i is attention iff (i + 1) % interval == 0
    heads: int
    kv_heads: int
    linear_k_heads: int
    linear_v_heads: int
    linear_head_dim: int = 32
    head_dim: int = 64


ARCHS = {
    # 8 layers: 6 GDN + 2 attention; sized so target + draft in bf16 stay under 40 MB.
    "target": Arch(hidden=384, layers=8, intermediate=768, full_attention_interval=4,
                   heads=6, kv_heads=2, linear_k_heads=6, linear_v_heads=12),
    # 2 layers: 1 GDN + 1 attention.
    "draft": Arch(hidden=256, layers=2, intermediate=640, full_attention_interval=2,
                  heads=4, kv_heads=2, linear_k_heads=4, linear_v_heads=8),
}


@dataclass(frozen=True)
class TrainConfig:
    model: str
    steps: int
    batch: int
    seq: int
    lr: float
    warmup: int
    min_lr_ratio: float
    weight_decay: float
    fim_weight: float
    seed: int
    eval_every: int
    log_every: int
    max_seconds: float


def make_config(arch: Arch, tok_dir: Path, max_positions: int) -> tf.Qwen3_5TextConfig:
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    vocab_size = 1 + max(max(data["model"]["vocab"].values()), max(ids.values()))
    return tf.Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=arch.hidden, intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim,
        linear_num_key_heads=arch.linear_k_heads, linear_num_value_heads=arch.linear_v_heads,
        linear_key_head_dim=arch.linear_head_dim, linear_value_head_dim=arch.linear_head_dim,
        linear_conv_kernel_dim=4, full_attention_interval=arch.full_attention_interval,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )


def middle_mask(spans: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """(n,) bool, True on the tokens inside any [start, end) span."""
    delta = torch.zeros(n + 1, dtype=torch.int32, device=device)
    delta.index_add_(0, spans[:, 0].to(device), torch.ones(len(spans), dtype=torch.int32, device=device))
    delta.index_add_(0, spans[:, 1].to(device), -torch.ones(len(spans), dtype=torch.int32, device=device))
    return delta.cumsum(0)[:n] > 0


def batches(tokens: torch.Tensor, weights: torch.Tensor, cfg: TrainConfig, gen: torch.Generator):
    """Endless ((batch, seq+1) windows, their token weights): each epoch a new random offset and
    window order."""
    n_windows = (tokens.numel() - 1) // (cfg.seq + 1) - 1
    while True:
        offset = int(torch.randint(0, cfg.seq + 1, (1,), generator=gen))
        order = torch.randperm(n_windows, generator=gen)
        for i in range(0, n_windows - cfg.batch + 1, cfg.batch):
            starts = offset + order[i:i + cfg.batch] * (cfg.seq + 1)
            idx = starts[:, None] + torch.arange(cfg.seq + 1)[None, :]
            idx = idx.to(tokens.device)
            yield tokens[idx].long(), weights[idx]


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def lm_loss(model, window: torch.Tensor, device: torch.device, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy of a (B, T+1) window: the mean, or weighted by the targets' weights."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=window[:, :-1]).logits
    ce = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten(), reduction="none")
    if weights is None:
        return ce.mean()
    w = weights[:, 1:].flatten()
    return (ce * w).sum() / w.sum()


@torch.no_grad()
def evaluate(model, heldout: dict[str, torch.Tensor], seq: int, device: torch.device) -> dict[str, float]:
    """Held-out loss per kind over non-overlapping windows (at most 64 per kind)."""
    model.eval()
    out = {}
    for kind, tokens in heldout.items():
        n = min(64, (tokens.numel() - 1) // seq)
        windows = torch.stack([tokens[i * seq:(i + 1) * seq + 1] for i in range(n)]).long()
        losses = [lm_loss(model, windows[i:i + 16], device).item() for i in range(0, n, 16)]
        out[kind] = float(np.mean(losses))
    model.train()
    return out


def make_optimizer(model, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # No weight decay on norms, biases, A_log / dt_bias (1-d) or the tied embedding.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def train(model, train_tokens, fim_spans, heldout, cfg: TrainConfig, device: torch.device, log) -> dict:
    opt = make_optimizer(model, cfg, device)
    gen = torch.Generator().manual_seed(cfg.seed)
    weights = 1 + (cfg.fim_weight - 1) * middle_mask(fim_spans, train_tokens.numel(), device).float()
    data = batches(train_tokens, weights, cfg, gen)
    start = time.perf_counter()
    recent: list[float] = []
    step = 0
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        window, window_weights = next(data)
        loss = lm_loss(model, window, device, window_weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            recent.append(loss.item())
            elapsed = time.perf_counter() - start
            log({"step": step, "loss": recent[-1], "lr": lr_at(step, cfg),
                 "tokens": (step + 1) * cfg.batch * cfg.seq, "elapsed": round(elapsed, 2)})
            if elapsed > cfg.max_seconds:
                log({"step": step, "stopped": "max_seconds"})
                break
        if (step + 1) % cfg.eval_every == 0:
            log({"step": step, "eval": evaluate(model, heldout, cfg.seq, device)})
    final_eval = evaluate(model, heldout, cfg.seq, device)
    log({"step": step, "eval": final_eval})
    seconds = time.perf_counter() - start
    return {"steps": step + 1, "tokens": (step + 1) * cfg.batch * cfg.seq, "seconds": round(seconds, 1),
            "tokens_per_second": round((step + 1) * cfg.batch * cfg.seq / seconds),
            "final_train_loss": float(np.mean(recent[-5:])), "heldout_loss": final_eval}


def save(model, tok_dir: Path, out: Path) -> None:
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    eos = [model.config.eos_token_id, model.config.pad_token_id]  # <|im_end|>, <|endoftext|>
    model.generation_config = tf.GenerationConfig(eos_token_id=eos, pad_token_id=model.config.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tok_dir / name, out / name)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(ARCHS), required=True)
    ap.add_argument("--data", type=Path, required=True, help="dir with train.npy, heldout_*.npy")
    ap.add_argument("--tokenizer", type=Path, required=True, help="dir with tokenizer.json")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--fim-weight", type=float, default=1.0, help="train-loss weight of FIM middle tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=1e9)
    ap.add_argument("--max-positions", type=int, default=4096)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    cfg = TrainConfig(a.model, a.steps, a.batch, a.seq, a.lr, a.warmup, a.min_lr_ratio,
                      a.weight_decay, a.fim_weight, a.seed, a.eval_every, a.log_every, a.max_seconds)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(a.seed)
    model = tf.Qwen3_5ForCausalLM(make_config(ARCHS[a.model], a.tokenizer, a.max_positions)).to(device)
    model.train()
    train_tokens = torch.from_numpy(np.load(a.data / "train.npy").astype(np.int32)).to(device)
    fim_spans = torch.from_numpy(np.load(a.data / "train_fim_spans.npy"))
    heldout = {k: torch.from_numpy(np.load(a.data / f"heldout_{k}.npy").astype(np.int32)).to(device)
               for k in HELDOUT_KINDS}
    a.out.mkdir(parents=True, exist_ok=True)
    log_file = (a.out / "train_log.jsonl").open("w")

    def log(record: dict) -> None:
        line = json.dumps({"model": a.model, **record})
        print(line, flush=True)
        log_file.write(line + "\n")

    params = sum(p.numel() for p in model.parameters())
    log({"params": params, "train_tokens": train_tokens.numel(), "config": asdict(cfg), "device": str(device)})
    summary = {"model": a.model, "params": params, "arch": asdict(ARCHS[a.model]), "config": asdict(cfg),
               "train_tokens_in_corpus": train_tokens.numel(),
               **train(model, train_tokens, fim_spans, heldout, cfg, device, log)}
    log_file.close()
    save(model, a.tokenizer, a.out)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
