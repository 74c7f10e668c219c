"""What every drafter's training in scripts/train_drafters.py shares: the recorded data of
scripts/drafter_data.py (tokens, hidden states, the train / held-out split), batching, the
optimisation loop with its schedule and logging, and loading / saving heads."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

STOP_IDS = (0, 2)  # <|endoftext|>, <|im_end|>


@dataclass(frozen=True)
class Sequence:
    start: int
    prompt_len: int
    length: int  # tokens of the sequence used for training (through the first stop token)


class Data:
    """tokens and recorded hidden states of every sequence, split into train and held-out."""

    def __init__(self, root: Path, heldout: float) -> None:
        self.tokens = np.load(root / "tokens.npy", mmap_mode="r")
        self.features = np.load(root / "features.npy", mmap_mode="r")  # [N, layers + 1, H] fp16
        seqs = []
        for s in json.loads((root / "sequences.json").read_text()):
            toks = self.tokens[s["start"] : s["start"] + s["length"]]
            gen = np.flatnonzero(np.isin(toks[s["prompt_len"] :], STOP_IDS))
            length = s["prompt_len"] + int(gen[0]) + 1 if len(gen) else s["length"]
            if length - s["prompt_len"] >= 2:
                seqs.append(Sequence(s["start"], s["prompt_len"], length))
        rng = np.random.default_rng(1234)  # the split does not depend on the training seed
        order = rng.permutation(len(seqs))
        n_held = max(1, int(len(seqs) * heldout))
        self.heldout = [seqs[i] for i in order[:n_held]]
        self.train = [seqs[i] for i in order[n_held:]]
        self.dev_tokens: torch.Tensor | None = None  # to_device(): copies on a GPU
        self.dev_features: torch.Tensor | None = None
        self.dev_slots: list[int] = []

    def to_device(self, device: torch.device, slots: list[int]) -> None:
        """Keep the tokens and the features of `slots` on `device` (a GPU), so that a batch is a
        gather there instead of a read and a conversion on the host every step."""
        self.dev_slots = list(slots)
        self.dev_tokens = torch.from_numpy(np.asarray(self.tokens, dtype=np.int64)).to(device)
        chunks = []
        for i in range(0, len(self.features), 1 << 20):  # bounded host memory per copy
            chunks.append(torch.from_numpy(np.ascontiguousarray(self.features[i : i + (1 << 20)][:, slots])).to(device))
        self.dev_features = torch.cat(chunks)  # [N, len(slots), H] fp16

    def batch(self, seqs: list[Sequence], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] and the features of `slots` [B, T, len(slots) * H] in fp32, on the default
        device; rows past a sequence's length are zero."""
        lengths = np.array([s.length for s in seqs])
        T = int(lengths.max())
        pos = np.arange(T)[None]
        idx = np.array([s.start for s in seqs])[:, None] + np.minimum(pos, lengths[:, None] - 1)
        valid = torch.as_tensor(pos < lengths[:, None]).to(torch.get_default_device())
        if self.dev_tokens is not None and self.dev_features is not None:
            i = torch.as_tensor(idx).to(self.dev_tokens.device)
            toks = self.dev_tokens[i]
            where = [self.dev_slots.index(k) for k in slots]
            feats = self.dev_features[i][:, :, where].float()
        else:
            toks = torch.from_numpy(np.asarray(self.tokens[idx.ravel()], dtype=np.int64).reshape(idx.shape))
            f = np.asarray(self.features[idx.ravel()][:, slots], dtype=np.float32)
            feats = torch.from_numpy(f.reshape(*idx.shape, len(slots), -1))
        toks = toks.to(valid.device) * valid
        feats = feats.to(valid.device).flatten(2) * valid[..., None]
        return toks, feats


def target_embedding(target: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), "pt") as f:
        key = next(k for k in f.keys() if k.endswith("embed_tokens.weight"))
        return f.get_tensor(key).float()


# ---------------------------------------------------------------- the loop

def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_loop(model, loss_fn, evaluate, data: Data, a, log) -> dict:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, betas=(0.9, 0.95),
                            weight_decay=0.01)
    rng = np.random.default_rng(a.seed)
    start, recent, step, done = time.perf_counter(), [], 0, 0
    stopped = None
    if a.steps <= 0 and a.warmup <= 40:
        raise SystemExit("--steps 0 needs --warmup > 40 (the step count is fixed at step 40)")
    steps = a.steps if a.steps > 0 else 10**9  # --steps 0: fixed at step 40
    t10 = None
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, a.lr, a.warmup)
        seqs = [data.train[i] for i in rng.choice(len(data.train), size=a.batch, replace=False)]
        loss = loss_fn(seqs, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        recent.append(loss.item())
        elapsed = time.perf_counter() - start
        if a.steps <= 0 and step == 10:
            t10 = elapsed
        if a.steps <= 0 and step == 40:
            per_step = (elapsed - t10) / 30
            # 10 % of the time is left to the periodic held-out evaluations
            steps = max(step + 1, int(a.max_seconds * 0.9 / per_step))
            log({"step": step, "steps_fixed": steps, "seconds_per_step": round(per_step, 4)})
        if step % a.log_every == 0 or step == steps - 1:
            log({"step": step, "loss": round(float(np.mean(recent[-a.log_every:])), 4),
                 "lr": lr_at(step, steps, a.lr, a.warmup), "elapsed": round(elapsed, 1)})
        if a.eval_every and (step + 1) % a.eval_every == 0:
            log({"step": step, "eval": evaluate(data.heldout[: a.eval_seqs])})
        if elapsed > a.max_seconds:
            stopped = "max_seconds"
            log({"step": step, "stopped": stopped})
            break
        step += 1
    final = evaluate(data.heldout)
    log({"step": done - 1, "eval": final, "heldout_sequences": len(data.heldout)})
    return {"steps": done, "seconds": round(time.perf_counter() - start, 1), "stopped": stopped,
            "final_train_loss": float(np.mean(recent[-50:])), "heldout": final}


def load_init(model: torch.nn.Module, head: str, path: Path) -> None:
    """Weights saved by an earlier run of this script (bf16 on disk; training goes on in fp32)."""
    from safetensors.torch import load_file

    if head == "mtp":
        state = {k.removeprefix("mtp."): v for k, v in load_file(path / "mtp.safetensors").items()}
    else:
        state = load_file(path / "model.safetensors")
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise SystemExit(f"--init {path}: missing {missing}, unexpected {unexpected}")


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}, path,
              metadata={"format": "pt"})
