"""The Weaver adapter ("Trees from Marginals", trymirai/weaver): a small pre-norm transformer that
re-scores a DFlash drafter's candidates along the paths of a growing draft tree.

Its prompt is the target's final-normed hidden state at the last committed position and DFlash's
final hidden states of block positions 1..D, each through output_norm and proposal_in, causal
among themselves at positions 0..D. A tree node at depth d (the root at 0) enters as
token_in(embed_norm(E_target[token])) at position d + 1; it sees the whole prompt, its ancestors
and itself. Its query out_norm(x) scores the candidates c of depth d + 1 (DFlash's top
candidate_pool_size there) as dflash_logit[c] + (W_lm[c] @ lm_head_query_in.weight) . query;
a softmax over the pool is Weaver's q(token | path).

Checkpoints: config.json with the published keys (d_model, d_embed, d_rank, num_layers,
num_heads, mlp_dim, K, candidate_pool_size, rope_base) and model.safetensors with the published
state_dict names, as scripts/convert_weaver.py writes them from the released .pth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.cpu_exp import silu
from engine.models.linear import Linear


class WeaverConfigError(ValueError):
    pass


@dataclass(frozen=True)
class WeaverConfig:
    d_model: int
    d_embed: int
    d_rank: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    max_depth: int  # "K"
    candidate_pool_size: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.d_rank // self.num_heads


def config_from_dict(cfg: dict[str, Any]) -> WeaverConfig:
    for key, supported in (("encoder_mode", "global_prompt"), ("score_head", "simple_score"), ("mlp", "swiglu")):
        if cfg.get(key, supported) != supported:
            raise WeaverConfigError(f"Weaver config: {key} {cfg[key]!r} is not supported (only {supported!r})")
    try:
        c = WeaverConfig(d_model=int(cfg["d_model"]), d_embed=int(cfg["d_embed"]), d_rank=int(cfg["d_rank"]),
                         num_layers=int(cfg["num_layers"]), num_heads=int(cfg["num_heads"]),
                         mlp_dim=int(cfg["mlp_dim"]), max_depth=int(cfg["K"]),
                         candidate_pool_size=int(cfg["candidate_pool_size"]),
                         rope_base=float(cfg.get("rope_base", 10000.0)), norm_eps=float(cfg.get("norm_eps", 1e-6)))
    except KeyError as e:
        raise WeaverConfigError(f"Weaver config: missing key {e.args[0]!r}") from None
    if c.d_rank % c.num_heads:
        raise WeaverConfigError(f"Weaver config: d_rank {c.d_rank} is not a multiple of num_heads {c.num_heads}")
    return c


def read_config(path: str | Path) -> WeaverConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise WeaverConfigError(f"{path} has no config.json (is it a Weaver directory?)")
    return config_from_dict(json.loads(cfg_file.read_text()))


class BiasRMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.bias = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.fast.rms_norm(x.astype(mx.float32), self.weight.astype(mx.float32), self.eps) + self.bias
        return y.astype(x.dtype)


class WeaverBlock(nn.Module):
    def __init__(self, c: WeaverConfig) -> None:
        super().__init__()
        self.c = c
        self.norm_attn = BiasRMSNorm(c.d_rank, c.norm_eps)
        self.qkv_proj = Linear(c.d_rank, 3 * c.d_rank, bias=False)
        self.o_proj = Linear(c.d_rank, c.d_rank, bias=False)
        self.norm_mlp = BiasRMSNorm(c.d_rank, c.norm_eps)
        self.gate_up_proj = Linear(c.d_rank, 2 * c.mlp_dim)
        self.down_proj = Linear(c.mlp_dim, c.d_rank)

    def qkv(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x [T, d_rank] at positions [T] -> q, k, v [heads, T, head_dim] (q and k rotated)."""
        c, T = self.c, x.shape[0]
        q, k, v = self.qkv_proj(self.norm_attn(x)).reshape(T, 3, c.num_heads, c.head_dim).transpose(1, 2, 0, 3)
        # one offset per row: rows are laid out as a batch of one-token sequences
        rot = [mx.fast.rope(t.transpose(1, 0, 2)[:, :, None], c.head_dim, traditional=False, base=c.rope_base,
                            scale=1.0, offset=positions)[:, :, 0].transpose(1, 0, 2) for t in (q, k)]
        return rot[0], rot[1], v

    def finish(self, x: mx.array, attn: mx.array) -> mx.array:
        """attn [heads, T, head_dim] -> the block's output rows [T, d_rank]."""
        x = x + self.o_proj(attn.transpose(1, 0, 2).reshape(x.shape[0], -1))
        gate, up = mx.split(self.gate_up_proj(self.norm_mlp(x)), 2, axis=-1)
        return x + self.down_proj(silu(gate) * up)


class Weaver(nn.Module):
    def __init__(self, config: WeaverConfig) -> None:
        super().__init__()
        c = self.config = config
        self.output_norm = BiasRMSNorm(c.d_model, c.norm_eps)
        self.embed_norm = BiasRMSNorm(c.d_embed, c.norm_eps)
        self.token_in = Linear(c.d_embed, c.d_rank)
        self.proposal_in = Linear(c.d_model, c.d_rank)
        self.blocks = [WeaverBlock(c) for _ in range(c.num_layers)]
        self.out_norm = BiasRMSNorm(c.d_rank, c.norm_eps)
        self.lm_head_query_in = Linear(c.d_rank, c.d_model, bias=False)

    def prompt_kv(self, h_target: mx.array, dflash_hidden: mx.array) -> list[tuple[mx.array, mx.array]]:
        """h_target [d_model], dflash_hidden [D, d_model] -> per block the prompt's (K, V) [heads, 1+D, hd]."""
        x = self.proposal_in(self.output_norm(mx.concatenate([h_target[None], dflash_hidden], axis=0)))
        P = x.shape[0]
        positions = mx.arange(P)
        causal = mx.tril(mx.ones((P, P), dtype=mx.bool_))
        kv = []
        for block in self.blocks:
            q, k, v = block.qkv(x, positions)
            kv.append((k, v))
            attn = mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.config.head_dim**-0.5,
                                                        mask=causal).squeeze(0)
            x = block.finish(x, attn)
        return kv

    def step(self, x: mx.array, depths: mx.array, prompt: list[tuple[mx.array, mx.array]],
             nodes: list[tuple[mx.array, mx.array]] | None, sees: mx.array) -> tuple[mx.array, list]:
        """Rows x [w, d_rank] (token_in(embed_norm(E[token]))) of tree nodes at `depths` [w].
        nodes: per block the K/V of the nodes stepped so far [heads, n, hd] (None before the root);
        sees [w, n] bool: which of those are ancestors of each row.
        -> (queries [w, d_rank], per block the rows' own (K, V) to append)."""
        w = x.shape[0]
        P = prompt[0][0].shape[1]
        mask = mx.concatenate([mx.ones((w, P), dtype=mx.bool_), sees, mx.eye(w, dtype=mx.bool_)], axis=1)
        new = []
        for i, block in enumerate(self.blocks):
            q, k, v = block.qkv(x, depths + 1)
            older = [] if nodes is None else [nodes[i]]
            keys = [prompt[i][0], *(kv[0] for kv in older), k]
            values = [prompt[i][1], *(kv[1] for kv in older), v]
            attn = mx.fast.scaled_dot_product_attention(
                q[None], mx.concatenate(keys, axis=1)[None], mx.concatenate(values, axis=1)[None],
                scale=self.config.head_dim**-0.5, mask=mask).squeeze(0)
            new.append((k, v))
            x = block.finish(x, attn)
        return self.out_norm(x), new
