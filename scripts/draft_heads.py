"""PyTorch versions of the draft heads the engine runs (engine/models/dflash.py, engine/models/mtp.py):
used to train the bundled drafters (scripts/train_drafters.py) and, in the tests, as the
reference the MLX code is held to. Parameter names are the checkpoints' own (z-lab's DFlash
layout; HF's `mtp.*` layout without the prefix), so `state_dict()` is what gets saved.

Written from the published architecture descriptions; the MTP layer is transformers' own
Qwen3.5 decoder layer, so its attention (output gate, partial RoPE, zero-centred norms) is HF's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Plain RMSNorm (Qwen3, DFlash): weight * x / rms(x), in float32."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the whole head. x [..., T, D], positions [..., T] (broadcast)."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D))
    ang = positions.float()[..., None] * inv  # [..., T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


@dataclass(frozen=True)
class DFlashShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    target_layer_ids: tuple[int, ...]
    rope_theta: float = 1e7
    eps: float = 1e-6


class DFlashLayer(nn.Module):
    def __init__(self, s: DFlashShape) -> None:
        super().__init__()
        self.s = s
        H, D = s.hidden, s.head_dim
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(H, s.heads * D, bias=False)
        self.self_attn.k_proj = nn.Linear(H, s.kv_heads * D, bias=False)
        self.self_attn.v_proj = nn.Linear(H, s.kv_heads * D, bias=False)
        self.self_attn.o_proj = nn.Linear(s.heads * D, H, bias=False)
        self.self_attn.q_norm = RMSNorm(D, s.eps)
        self.self_attn.k_norm = RMSNorm(D, s.eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, s.intermediate, bias=False)
        self.mlp.up_proj = nn.Linear(H, s.intermediate, bias=False)
        self.mlp.down_proj = nn.Linear(s.intermediate, H, bias=False)
        self.input_layernorm = RMSNorm(H, s.eps)
        self.post_attention_layernorm = RMSNorm(H, s.eps)

    def _kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, s = self.self_attn, self.s
        B, T, _ = x.shape
        k = a.k_norm(a.k_proj(x).view(B, T, s.kv_heads, s.head_dim)).transpose(1, 2)
        v = a.v_proj(x).view(B, T, s.kv_heads, s.head_dim).transpose(1, 2)
        return rope(k, pos[:, None], s.rope_theta), v

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, q_pos: torch.Tensor, ctx_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [B, Q, H] block rows at q_pos [B, Q]; ctx [B, T, H] (projected) at ctx_pos [B, T];
        mask [B, 1, Q, T + Q] bool (True = visible)."""
        a, s = self.self_attn, self.s
        B, Q, _ = x.shape
        h = self.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(B, Q, s.heads, s.head_dim)).transpose(1, 2)
        q = rope(q, q_pos[:, None], s.rope_theta)
        k_ctx, v_ctx = self._kv(ctx, ctx_pos)
        k_blk, v_blk = self._kv(h, q_pos)
        k, v = torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=s.heads != s.kv_heads)
        x = x + a.o_proj(out.transpose(1, 2).reshape(B, Q, -1))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class DFlash(nn.Module):
    """z-lab's DFlashDraftModel (full-attention layers, bidirectional in the block)."""

    def __init__(self, s: DFlashShape) -> None:
        super().__init__()
        self.s = s
        self.fc = nn.Linear(len(s.target_layer_ids) * s.hidden, s.hidden, bias=False)
        self.hidden_norm = RMSNorm(s.hidden, s.eps)
        self.layers = nn.ModuleList(DFlashLayer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.eps)

    def forward(self, block: torch.Tensor, features: torch.Tensor, q_pos: torch.Tensor, ctx_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """block [B, Q, H] embedded block rows; features [B, T, n_ids * H] -> final hidden [B, Q, H]."""
        ctx = self.hidden_norm(self.fc(features))
        x = block
        for layer in self.layers:
            x = layer(x, ctx, q_pos, ctx_pos, mask)
        return self.norm(x)

    def hf_config(self, vocab_size: int, mask_token_id: int, block_size: int, num_target_layers: int) -> dict:
        """config.json as z-lab publishes it (DFlash keys nested in dflash_config)."""
        s = self.s
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": s.hidden,
            "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "head_dim": s.head_dim, "intermediate_size": s.intermediate, "vocab_size": vocab_size,
            "rms_norm_eps": s.eps, "rope_theta": s.rope_theta, "max_position_embeddings": 4096,
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * s.layers, "block_size": block_size,
            "num_target_layers": num_target_layers,
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(s.target_layer_ids)},
        }


def dflash_training_mask(anchors: torch.Tensor, T: int, L: int) -> torch.Tensor:
    """anchors [B, A] -> bool [B, 1, A * L, T + A * L]: block row (a, j) sees the context before
    anchor a and its own block (bidirectionally), as at inference."""
    B, A = anchors.shape
    ctx = torch.arange(T, device=anchors.device)[None, None, None, :] < anchors[:, :, None, None]  # [B, A, 1, T]
    ctx = ctx.expand(B, A, L, T).reshape(B, A * L, T)
    blk = torch.block_diag(*[torch.ones(L, L, dtype=torch.bool, device=anchors.device)] * A)
    return torch.cat([ctx, blk.expand(B, A * L, A * L)], -1)[:, None]


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default: uniformly between the second and the third-to-last layer."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


class MTP(nn.Module):
    """The Qwen3.5 MTP head (HF layout without the `mtp.` prefix); its decoder layer is
    transformers' Qwen3_5DecoderLayer as a full-attention layer."""

    def __init__(self, text_config) -> None:
        super().__init__()
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        cfg = text_config.__class__(**{**text_config.to_dict(), "num_hidden_layers": 1,
                                        "layer_types": ["full_attention"]})
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = hf.Qwen3_5RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = hf.Qwen3_5RMSNorm(H, eps=eps)
        self.layers = nn.ModuleList([hf.Qwen3_5DecoderLayer(cfg, 0)])
        self.norm = hf.Qwen3_5RMSNorm(H, eps=eps)
        self.rotary = hf.Qwen3_5TextRotaryEmbedding(cfg)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embedded = embed(x_{i+1}), hidden = h_i [B, T, H] at positions i [B, T] -> y [B, T, H]
        (causal over the T rows)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], -1))
        pe = self.rotary(x, positions[None].expand(3, -1, -1))  # text-only M-RoPE: 3 equal rows (HF 5.17 wants all 3)
        T = x.shape[1]
        causal = torch.full((T, T), float("-inf"), device=x.device).triu(1)[None, None].to(x.dtype)
        for layer in self.layers:
            x = layer(x, position_embeddings=pe, attention_mask=causal)
        return self.norm(x)

    def unrolled(self, embed: torch.Tensor, toks: torch.Tensor, hidden: torch.Tensor,
                 passes: int) -> list[torch.Tensor]:
        """K passes of recursive drafting under teacher forcing. Pass 1's row i is
        (embed(x_{i+1}), h_i) at position i; pass k's row i is (embed(x_{i+k}), pass k-1's output of
        row i) at position i + k - 1 and predicts x_{i+k+1}. The head's one decoder layer is written
        out here (transformers' Qwen3.5 layer, its modules and order) so that each pass computes only
        its own rows and attends to the keys and values the earlier passes left, as the engine's draft
        attends to its cache: K passes cost K times one, not K^2 / 2."""
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        (layer,) = self.layers
        attn = layer.self_attn
        B, T = toks.shape
        D = attn.head_dim
        rows = [n for n in (T - 1 - k for k in range(1, passes + 1)) if n > 0]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        prev = hidden[:, : rows[0]]
        for k, n in enumerate(rows, start=1):
            e = F.embedding(toks[:, k : k + n], embed)
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(prev[:, :n])], -1))
            pos = torch.arange(n) + (k - 1)
            cos, sin = self.rotary(x, pos[None, None].expand(3, B, -1))  # as MTP.forward: 3 equal M-RoPE rows
            h = layer.input_layernorm(x)
            q, gate = torch.chunk(attn.q_proj(h).view(B, n, -1, 2 * D), 2, dim=-1)
            q = attn.q_norm(q).transpose(1, 2)
            kk = attn.k_norm(attn.k_proj(h).view(B, n, -1, D)).transpose(1, 2)
            q, kk = hf.apply_rotary_pos_emb(q, kk, cos, sin)
            keys.append(kk)
            values.append(attn.v_proj(h).view(B, n, -1, D).transpose(1, 2))
            groups = q.shape[1] // kk.shape[1]
            K = torch.cat(keys, 2).repeat_interleave(groups, 1)
            V = torch.cat(values, 2).repeat_interleave(groups, 1)
            mask = unrolled_mask(rows[:k])[..., -n:, :]
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=attn.scaling)
            o = o.transpose(1, 2).reshape(B, n, -1) * torch.sigmoid(gate.reshape(B, n, -1))
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            prev = self.norm(x)
            outs.append(prev)
        return outs


def unrolled_mask(rows: list[int]) -> torch.Tensor:
    """The additive mask over the rows of passes 1..K (rows[k-1] of pass k, concatenated): pass 1's
    row i sees pass 1's rows 0..i (the committed rows of the head's cache); pass j's row i (j >= 2)
    sees those and the rows i of passes 2..j, as depth j of a recursive draft sees the committed
    rows and the draft's own earlier depths."""
    which = torch.cat([torch.full((n,), k) for k, n in enumerate(rows)])
    where = torch.cat([torch.arange(n) for n in rows])
    q_pass, q_row = which[:, None], where[:, None]
    k_pass, k_row = which[None, :], where[None, :]
    see = ((k_pass == 0) & (k_row <= q_row)) | ((k_pass >= 1) & (k_pass <= q_pass) & (k_row == q_row))
    return torch.zeros(see.shape).masked_fill(~see, float("-inf"))[None, None]


def init_like_hf(module: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Normal(0, std) matrices; norms as their classes initialise them. Drawn on the CPU whatever the
    device, so one seed gives the same start on a GPU."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                scale = std / (math.sqrt(2) if "o_proj" in name or "down" in name else 1.0)
                p.copy_(torch.randn(p.shape, generator=g, device="cpu") * scale)


class BiasRMSNorm(nn.Module):
    """Weaver's affine RMSNorm: weight * x / rms(x) + bias, in float32."""

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.bias = nn.Parameter(torch.zeros(dims))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)) + self.bias).to(x.dtype)


@dataclass(frozen=True)
class WeaverShape:
    """The published Weaver config keys (trymirai/weaver)."""

    d_model: int  # the target's hidden size
    d_embed: int  # the target's embedding size
    d_rank: int  # Weaver's width
    num_layers: int
    num_heads: int
    mlp_dim: int
    K: int  # deepest depth it scores
    candidate_pool_size: int
    rope_base: float = 10000.0

    def config(self) -> dict:
        return {"d_model": self.d_model, "d_embed": self.d_embed, "d_rank": self.d_rank,
                "num_layers": self.num_layers, "num_heads": self.num_heads, "mlp_dim": self.mlp_dim, "K": self.K,
                "candidate_pool_size": self.candidate_pool_size, "rope_base": self.rope_base,
                "encoder_mode": "global_prompt", "score_head": "simple_score", "mlp": "swiglu"}


class WeaverBlock(nn.Module):
    def __init__(self, s: WeaverShape) -> None:
        super().__init__()
        self.s = s
        self.norm_attn = BiasRMSNorm(s.d_rank)
        self.qkv_proj = nn.Linear(s.d_rank, 3 * s.d_rank, bias=False)
        self.o_proj = nn.Linear(s.d_rank, s.d_rank, bias=False)
        self.norm_mlp = BiasRMSNorm(s.d_rank)
        self.gate_up_proj = nn.Linear(s.d_rank, 2 * s.mlp_dim)
        self.down_proj = nn.Linear(s.mlp_dim, s.d_rank)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_rank], positions [B, T], mask [B, 1, T, T] bool."""
        s = self.s
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(self.norm_attn(x)).view(B, T, 3, s.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rope(q, positions[:, None], s.rope_base), rope(k, positions[:, None], s.rope_base)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        gate, up = self.gate_up_proj(self.norm_mlp(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class Weaver(nn.Module):
    """Weaver ("Trees from Marginals"): re-scores DFlash's candidates along tree paths.

    The prompt is [proposal_in(output_norm(h_target)), proposal_in(output_norm(dflash_hidden[d]))
    for d = 1..D] (causal among itself, positions 0..D); a tree node at depth d (the root at 0) is
    token_in(embed_norm(E[token])) at position d + 1 and sees the whole prompt, its ancestors and
    itself. Its query out_norm(x) scores the candidates c of depth d + 1 as
    dflash_logit[c] + (W_lm[c] @ lm_head_query_in.weight) . query."""

    def __init__(self, s: WeaverShape) -> None:
        super().__init__()
        self.s = s
        self.output_norm = BiasRMSNorm(s.d_model)
        self.embed_norm = BiasRMSNorm(s.d_embed)
        self.token_in = nn.Linear(s.d_embed, s.d_rank)
        self.proposal_in = nn.Linear(s.d_model, s.d_rank)
        self.blocks = nn.ModuleList(WeaverBlock(s) for _ in range(s.num_layers))
        self.out_norm = BiasRMSNorm(s.d_rank)
        self.lm_head_query_in = nn.Linear(s.d_rank, s.d_model, bias=False)

    def path_queries(self, h_target: torch.Tensor, dflash_hidden: torch.Tensor,
                     path_embeds: torch.Tensor) -> torch.Tensor:
        """Teacher forcing along one path per row: h_target [B, d_model], dflash_hidden [B, D, d_model],
        path_embeds [B, N, d_embed] (the root's and the path's target embeddings, depths 0..N-1)
        -> queries [B, N, d_rank]."""
        B, D = dflash_hidden.shape[:2]
        N = path_embeds.shape[1]
        prompt = self.proposal_in(self.output_norm(torch.cat([h_target[:, None], dflash_hidden], 1)))
        nodes = self.token_in(self.embed_norm(path_embeds))
        x = torch.cat([prompt, nodes], 1)
        P = D + 1
        positions = torch.cat([torch.arange(P), torch.arange(1, N + 1)])[None].expand(B, -1)
        see = torch.zeros(P + N, P + N, dtype=torch.bool)
        see[:P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
        see[P:, :P] = True
        see[P:, P:] = torch.ones(N, N, dtype=torch.bool).tril()
        for block in self.blocks:
            x = block(x, positions, see[None, None])
        return self.out_norm(x[:, P:])

    def scores(self, queries: torch.Tensor, cand_logits: torch.Tensor, cand_rows: torch.Tensor) -> torch.Tensor:
        """queries [..., d_rank], cand_logits [..., P] (DFlash's), cand_rows [..., P, d_model] (W_lm rows)."""
        return cand_logits + torch.einsum("...pm,...m->...p", cand_rows, self.lm_head_query_in(queries))
