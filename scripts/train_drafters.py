"""Train the bundled target's drafters on its own continuations (scripts/drafter_data.py).

    python scripts/train_drafters.py dflash --data build/drafter_data --out OUT/dflash [--steps 3000]
    python scripts/train_drafters.py mtp --data build/drafter_data --out OUT/mtp [--steps 3000]
    python scripts/train_drafters.py weaver --data build/drafter_data --dflash OUT/dflash --out OUT/weaver

PyTorch, on a CUDA GPU if there is one (--device), else the CPU; fp32 (TF32 matmuls on a GPU).
The target is frozen and never run: its hidden states were recorded with the data, and only its
embedding (= its tied lm_head) is read from the checkpoint. Reproducible from --seed;
--max-seconds bounds the wall clock (the run then stops early and says so in the summary).
--steps 0 fits the run into --max-seconds: the step count is fixed from the measured speed of
steps 10-40 (before the warm-up ends, so the learning-rate schedule is the one `--steps N` with
the logged N gives).

- dflash: z-lab's DFlash recipe at small scale. For random anchors a of a continuation, the block
  [x_a, MASK x 15] at positions a .. a+15 sees the target's hidden states (after
  --target-layers) of positions < a and its own block; position k predicts x_{a+k}, with loss
  weight exp(-(k - 1) / 7). Saved in z-lab's layout (config.json with dflash_config,
  model.safetensors in bf16).
- mtp: the Qwen3.5 MTP head. Row i of a sequence is (embed(x_{i+1}), h_i) at position i and
  predicts x_{i+2} (h = the target's final-normed hidden state); --passes K unrolls recursive
  drafting K deep: pass k feeds the head its own outputs (row i: (embed(x_{i+k}), pass k-1's output)
  at position i + k - 1, seeing the first pass's rows up to i and its own earlier passes' row i, as
  the engine's draft sees its cache) and predicts x_{i+k+1}, with loss weight --pass-decay^(k-1).
  --soft S moves a share S of each pass's loss from the recorded token to the target's own
  distribution there (read from the recorded hidden state and the tied lm_head). Saved as `mtp.*`
  tensors (HF layout, zero-centred norms) in mtp.safetensors, bf16.
- weaver: the Weaver adapter over a trained DFlash drafter (frozen, run on the fly). Teacher forcing
  along the target's own continuation: for an anchor a, the prompt is the target's final-normed
  hidden state at a - 1 and DFlash's hidden states of the block; the node at depth d is x_{a+d}
  and is scored over DFlash's top --pool candidates of depth d + 1, with x_{a+d+1} as the label
  (skipped when outside the pool), weighted like DFlash. Saved as the published .pth ({config,
  state_dict}) and converted by scripts/convert_weaver.py.

Loss only on the target's own continuation tokens (not the prompt), up to and including its
first stop token. The last --heldout share of sequences is kept for evaluation: per block (or
per row) the length of the greedy prefix the drafter gets right, which is what a chain accepts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import draft_heads  # noqa: E402
from drafter_training import (  # noqa: E402
    Data,
    Sequence,
    load_init,
    save_safetensors,
    target_embedding,
    train_loop,
)

ROOT = HERE.parent
# ---------------------------------------------------------------- DFlash

def dflash_batch(data: Data, seqs: list[Sequence], slots: list[int], anchors: int, block: int,
                 rng: np.random.Generator, all_anchors: bool = False):
    """-> tokens [B, T], features [B, T, F], anchors [B, A], labels [B, A, block-1], valid [B, A, block-1]."""
    toks, feats = data.batch(seqs, slots)
    A = anchors
    anc_np = np.zeros((len(seqs), A), dtype=np.int64)
    for i, s in enumerate(seqs):
        lo, hi = s.prompt_len - 1, s.length - 2  # the anchor's next token must exist
        choices = np.arange(lo, hi + 1)
        pick = choices[:A] if all_anchors else rng.choice(choices, size=A, replace=len(choices) < A)
        anc_np[i, : len(pick)] = pick
    anc = torch.as_tensor(anc_np).to(toks.device)
    k = torch.arange(1, block)
    pos = anc[:, :, None] + k  # [B, A, block-1]
    lengths = torch.tensor([s.length for s in seqs])
    valid = pos < lengths[:, None, None]
    labels = torch.gather(toks, 1, pos.clamp(max=toks.shape[1] - 1).flatten(1)).view_as(pos)
    return toks, feats, anc, labels, valid


def dflash_forward(model: draft_heads.DFlash, embed: torch.Tensor, mask_id: int, block: int, toks, feats, anc):
    """-> final hidden of block positions 1.. [B, A, block-1, H]."""
    B, A = anc.shape
    T = toks.shape[1]
    block_ids = torch.full((B, A, block), mask_id, dtype=torch.long)
    block_ids[:, :, 0] = torch.gather(toks, 1, anc)
    x = F.embedding(block_ids.view(B, A * block), embed)
    q_pos = (anc[:, :, None] + torch.arange(block)).view(B, A * block)
    mask = draft_heads.dflash_training_mask(anc, T, block)
    h = model(x, feats, q_pos, torch.arange(T)[None].expand(B, T), mask)
    return h.view(B, A, block, -1)[:, :, 1:]


def dflash_loss(model, embed, mask_id, block, gamma, batch):
    toks, feats, anc, labels, valid = batch
    h = dflash_forward(model, embed, mask_id, block, toks, feats, anc)
    w = (torch.exp(-(torch.arange(block - 1, dtype=torch.float32)) / gamma) * valid).flatten()
    keep = w > 0  # the lm_head over the vocabulary dominates the cost: only rows with a label
    ce = F.cross_entropy(h.flatten(0, 2)[keep] @ embed.T, labels.flatten()[keep], reduction="none")
    return (ce * w[keep]).sum() / w.sum()


@torch.no_grad()
def dflash_eval(model, embed, mask_id, block, data: Data, slots, seqs: list[Sequence]) -> dict[str, float]:
    """Mean greedy prefix accepted per block (acceptance length minus the bonus) over every anchor."""
    model.eval()
    lengths, per_pos = [], np.zeros(block - 1)
    rng = np.random.default_rng(0)
    for s in seqs:
        n_anc = s.length - s.prompt_len
        batch = dflash_batch(data, [s], slots, n_anc, block, rng, all_anchors=True)
        toks, feats, anc, labels, valid = batch
        for a0 in range(0, n_anc, 64):  # bounded memory on long sequences
            sl = slice(a0, a0 + 64)
            h = dflash_forward(model, embed, mask_id, block, toks, feats, anc[:, sl])
            hit = ((h @ embed.T).argmax(-1) == labels[:, sl]) & valid[:, sl]
            run = hit.int().cumprod(-1)
            lengths += run.sum(-1).flatten().tolist()
            per_pos += run.sum((0, 1)).cpu().numpy()
    model.train()
    return {"accepted_per_block": float(np.mean(lengths)),
            "hit_rate_pos1_4_8_15": [round(float(per_pos[i] / len(lengths)), 3) for i in (0, 3, 7, block - 2)]}


# ---------------------------------------------------------------- MTP

def mtp_batch(data: Data, seqs: list[Sequence], final_slot: int):
    """tokens [B, T], the target's final-normed hidden states [B, T, H], sequence and prompt lengths."""
    toks, hidden = data.batch(seqs, [final_slot])
    lengths = torch.tensor([s.length for s in seqs])
    prompt = torch.tensor([s.prompt_len for s in seqs])
    return toks, hidden, lengths, prompt


def pass_valid(T: int, k: int, lengths: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """[B, T-1-k]: pass k's row i predicts x_{i+k+1}; trained where that is a continuation token."""
    idx = torch.arange(T - 1 - k)[None] + k + 1
    return (idx < lengths[:, None].to(idx.device)) & (idx >= prompt[:, None].to(idx.device))


def mtp_loss(model, embed, batch, passes: int, decay: float, soft: float):
    """Sum over passes of decay^(k-1) x the pass's mean loss over its continuation rows: (1 - soft)
    x cross-entropy against the recorded token + soft x cross-entropy against the target's own
    distribution there (softmax of its final-normed hidden state times the tied lm_head: what the
    target samples from, so what a drafted token is accepted against)."""
    toks, hidden, lengths, prompt = batch
    T = toks.shape[1]
    target = F.softmax(hidden @ embed.T, -1) if soft > 0 else None  # [B, T, V]: row j is x_{j+1}'s
    total = torch.zeros(())
    for k, y in enumerate(model.unrolled(embed, toks, hidden, passes), 1):
        v = pass_valid(T, k, lengths, prompt)
        if not v.any():
            continue
        logp = F.log_softmax(y[v] @ embed.T, -1)
        loss = torch.zeros(())
        if soft < 1:
            loss = loss + (1 - soft) * F.nll_loss(logp, toks[:, k + 1 :][v])
        if target is not None:
            loss = loss - soft * (target[:, k : k + y.shape[1]][v] * logp).sum(-1).mean()
        total = total + decay ** (k - 1) * loss
    return total


@torch.no_grad()
def mtp_eval(model, embed, data: Data, final_slot: int, seqs: list[Sequence], passes: int) -> dict[str, float]:
    """Teacher-forced along the recorded continuation: depth 1's top-1 accuracy, depths 1 and 2 both
    right, and the mean greedy prefix a chain of `passes` depths keeps from a row (depth k counted
    only where its token is a continuation token)."""
    model.eval()
    hit1 = hit2 = n1 = n2 = 0
    kept = 0.0
    for i in range(0, len(seqs), 16):
        toks, hidden, lengths, prompt = mtp_batch(data, seqs[i : i + 16], final_slot)
        T = toks.shape[1]
        ys = model.unrolled(embed, toks, hidden, passes)
        run = None
        for k, y in enumerate(ys, 1):
            v = pass_valid(T, k, lengths, prompt)
            ok = ((y @ embed.T).argmax(-1) == toks[:, k + 1 :]) & v
            run = ok if run is None else run[:, : ok.shape[1]] & ok  # right at every depth so far
            kept += float(run.sum())
            if k == 1:
                hit1, n1 = hit1 + int(ok.sum()), n1 + int(v.sum())
            elif k == 2:
                hit2, n2 = hit2 + int(run.sum()), n2 + int(v.sum())
    model.train()
    return {"depth1_acc": round(hit1 / max(n1, 1), 4), "depth2_both_acc": round(hit2 / max(n2, 1), 4),
            f"chain{passes}_kept": round(kept / max(n1, 1), 4)}


# ---------------------------------------------------------------- Weaver

def load_dflash_torch(path: Path) -> tuple[draft_heads.DFlash, dict]:
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    shape = draft_heads.DFlashShape(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                                    heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"],
                                    head_dim=cfg["head_dim"], intermediate=cfg["intermediate_size"],
                                    target_layer_ids=tuple(cfg["dflash_config"]["target_layer_ids"]),
                                    rope_theta=cfg["rope_theta"], eps=cfg["rms_norm_eps"])
    model = draft_heads.DFlash(shape)
    model.load_state_dict({k: v.float() for k, v in load_file(path / "model.safetensors").items()})
    model.requires_grad_(False).eval()
    return model, cfg


def weaver_inputs(dflash, embed, mask_id, block, pool, batch):
    """DFlash's view of each anchor's block: (hidden [B*A, D, H], pool ids and logits [B*A, D, P],
    the pool index of each depth's true token or -1 [B*A, D], valid [B*A, D])."""
    toks, feats, anc, labels, valid = batch
    with torch.no_grad():
        h = dflash_forward(dflash, embed, mask_id, block, toks, feats[..., :-embed.shape[1]], anc)
        logits = h @ embed.T
        pool_logits, pool_ids = logits.topk(pool, dim=-1)
    where = pool_ids == labels[..., None]
    target = torch.where(where.any(-1), where.int().argmax(-1), torch.full_like(labels, -1))
    return (h.flatten(0, 1), pool_ids.flatten(0, 1), pool_logits.flatten(0, 1), target.flatten(0, 1),
            valid.flatten(0, 1))


def weaver_scores(weaver, embed, toks, feats, anc, h, pool_ids, pool_logits):
    """Weaver's logits over the pool along each anchor's true path, [B*A, D, P]."""
    B, A = anc.shape
    D = h.shape[1]
    final = feats[..., -embed.shape[1]:]  # the final-normed hidden state is the last tap
    h_target = torch.gather(final, 1, (anc - 1)[..., None].expand(B, A, final.shape[-1])).flatten(0, 1)
    path = torch.gather(toks, 1, (anc[:, :, None] + torch.arange(D)).clamp(max=toks.shape[1] - 1).flatten(1))
    queries = weaver.path_queries(h_target, h, F.embedding(path.view(B * A, D), embed))
    return weaver.scores(queries, pool_logits, embed[pool_ids])


def weaver_loss(weaver, dflash, embed, mask_id, block, pool, gamma, batch):
    toks, feats, anc = batch[0], batch[1], batch[2]
    h, pool_ids, pool_logits, target, valid = weaver_inputs(dflash, embed, mask_id, block, pool, batch)
    s = weaver_scores(weaver, embed, toks, feats, anc, h, pool_ids, pool_logits)
    keep = valid & (target >= 0)
    w = torch.exp(-(torch.arange(block - 1, dtype=torch.float32)) / gamma).expand_as(keep)[keep]
    ce = F.cross_entropy(s[keep], target[keep], reduction="none")
    return (ce * w).sum() / w.sum().clamp(min=1e-6)  # a batch whose true tokens all miss the pool adds 0


@torch.no_grad()
def weaver_eval(weaver, dflash, embed, mask_id, block, pool, data: Data, slots, seqs) -> dict[str, float]:
    """Greedy prefix accepted per block: Weaver's top choice along the true path vs DFlash's."""
    weaver.eval()
    w_len, d_len = [], []
    rng = np.random.default_rng(0)
    for s in seqs:
        n_anc = s.length - s.prompt_len
        toks, feats, anc, labels, valid = dflash_batch(data, [s], slots, n_anc, block, rng, all_anchors=True)
        for a0 in range(0, n_anc, 64):
            b = (toks, feats, anc[:, a0 : a0 + 64], labels[:, a0 : a0 + 64], valid[:, a0 : a0 + 64])
            h, pool_ids, pool_logits, target, ok = weaver_inputs(dflash, embed, mask_id, block, pool, b)
            sc = weaver_scores(weaver, embed, toks, feats, b[2], h, pool_ids, pool_logits)
            w_hit = (sc.argmax(-1) == target) & (target >= 0) & ok
            d_hit = (target == 0) & ok  # DFlash's own top-1 is pool index 0
            w_len += w_hit.int().cumprod(-1).sum(-1).tolist()
            d_len += d_hit.int().cumprod(-1).sum(-1).tolist()
    weaver.train()
    return {"weaver_accepted_per_block": float(np.mean(w_len)), "dflash_accepted_per_block": float(np.mean(d_len))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", choices=["dflash", "mtp", "weaver"])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--target", type=Path, default=ROOT / "engine" / "bundled" / "target")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3000, help="0: as many as fit into --max-seconds")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=16, help="dflash: blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", type=float, default=0.04)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-seqs", type=int, default=24)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--max-seconds", type=float, default=3300)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--init", type=Path, help="continue from a saved head (its OUT dir of an earlier run)")
    # DFlash shape
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--target-layers", default="1,3,5")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--gamma", type=float, default=7.0)
    # mtp
    ap.add_argument("--passes", type=int, default=2, help="mtp: recursive depths unrolled in training")
    ap.add_argument("--pass-decay", type=float, default=0.5, help="mtp: pass k's loss weight is decay^(k-1)")
    ap.add_argument("--soft", type=float, default=0.0,
                    help="mtp: share of the loss against the target's distribution (the rest: the recorded token)")
    ap.add_argument("--eval-passes", type=int, default=6, help="mtp: depths of the held-out chain")
    # Weaver shape
    ap.add_argument("--dflash", type=Path, help="weaver: the trained DFlash drafter it re-scores")
    ap.add_argument("--pool", type=int, default=64, help="weaver: DFlash candidates scored per depth")
    ap.add_argument("--rank", type=int, default=128, help="weaver: width (d_rank)")
    ap.add_argument("--weaver-layers", type=int, default=2)
    ap.add_argument("--weaver-heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=256)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    if device.type == "cuda":
        torch.set_default_device(device)  # every tensor the heads and the batches make
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(a.seed)
    import transformers as tf

    tcfg = tf.AutoConfig.from_pretrained(a.target)
    embed = target_embedding(a.target).to(device)
    data = Data(a.data, a.heldout)
    a.out.mkdir(parents=True, exist_ok=True)
    log_file = (a.out / "train_log.jsonl").open("w")

    def log(record: dict) -> None:
        line = json.dumps({"head": a.head, **record})
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    final_slot = tcfg.num_hidden_layers  # features.npy: after layer 0..L-1, then the final norm
    if a.head == "dflash":
        ids = tuple(int(i) for i in a.target_layers.split(","))
        tok = json.loads((a.target / "tokenizer.json").read_text())
        mask_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|MASK|>")
        shape = draft_heads.DFlashShape(hidden=tcfg.hidden_size, layers=a.layers, heads=tcfg.num_attention_heads,
                                        kv_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
                                        intermediate=a.intermediate, target_layer_ids=ids,
                                        rope_theta=tcfg.rope_parameters["rope_theta"], eps=tcfg.rms_norm_eps)
        model = draft_heads.DFlash(shape)
        draft_heads.init_like_hf(model, seed=a.seed)
        slots = list(ids)

        def loss_fn(seqs, rng):
            return dflash_loss(model, embed, mask_id, a.block, a.gamma,
                               dflash_batch(data, seqs, slots, a.anchors, a.block, rng))

        def evaluate(seqs):
            return dflash_eval(model, embed, mask_id, a.block, data, slots, seqs)
    elif a.head == "weaver":
        if a.dflash is None:
            raise SystemExit("weaver needs --dflash DIR (a trained DFlash drafter)")
        dflash, dcfg = load_dflash_torch(a.dflash)
        mask_id, block = dcfg["dflash_config"]["mask_token_id"], dcfg["block_size"]
        shape_w = draft_heads.WeaverShape(d_model=tcfg.hidden_size, d_embed=tcfg.hidden_size, d_rank=a.rank,
                                          num_layers=a.weaver_layers, num_heads=a.weaver_heads, mlp_dim=a.mlp,
                                          K=block - 1, candidate_pool_size=a.pool)
        model = draft_heads.Weaver(shape_w)
        draft_heads.init_like_hf(model, seed=a.seed)
        slots = [*dcfg["dflash_config"]["target_layer_ids"], final_slot]

        def loss_fn(seqs, rng):
            batch = dflash_batch(data, seqs, slots, a.anchors, block, rng)
            return weaver_loss(model, dflash, embed, mask_id, block, a.pool, a.gamma, batch)

        def evaluate(seqs):
            return weaver_eval(model, dflash, embed, mask_id, block, a.pool, data, slots, seqs)
    else:
        model = draft_heads.MTP(tcfg)
        draft_heads.init_like_hf(model, seed=a.seed)

        def loss_fn(seqs, rng):
            return mtp_loss(model, embed, mtp_batch(data, seqs, final_slot), a.passes, a.pass_decay, a.soft)

        def evaluate(seqs):
            return mtp_eval(model, embed, data, final_slot, seqs, a.eval_passes)

    if device.type == "cuda":
        data.to_device(device, slots if a.head != "mtp" else [final_slot])
    if a.init is not None:
        load_init(model, a.head, a.init)
    params = sum(p.numel() for p in model.parameters())
    log({"params": params, "train_sequences": len(data.train), "heldout_sequences": len(data.heldout),
         "args": {k: str(v) for k, v in vars(a).items()}})
    log({"step": -1, "eval": evaluate(data.heldout[: a.eval_seqs])})
    summary = {"head": a.head, "params": params, **train_loop(model, loss_fn, evaluate, data, a, log)}
    if a.head == "dflash":
        (a.out / "config.json").write_text(json.dumps(
            model.hf_config(tcfg.vocab_size, mask_id, a.block, tcfg.num_hidden_layers), indent=1))
        save_safetensors(model.state_dict(), a.out / "model.safetensors")
    elif a.head == "weaver":
        import convert_weaver

        torch.save({"config": shape_w.config(), "state_dict": model.state_dict()}, a.out / "weaver.pth")
        convert_weaver.main([str(a.out / "weaver.pth"), str(a.out)])
    else:
        tensors = {f"mtp.{k}": v for k, v in model.state_dict().items() if "rotary" not in k}
        save_safetensors(tensors, a.out / "mtp.safetensors")
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    log_file.close()
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
