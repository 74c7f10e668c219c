"""Where each row and column of a small Qwen3.5 model (or DFlash drafter) goes in a wider one:
the index maps of scripts/widen_checkpoint.py, which explains why they keep the computation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Dims:
    """The sizes of one model that the widening maps between (a target or a DFlash drafter)."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary: float  # share of head_dim that RoPE turns
    k_heads: int = 0  # GDN (0: no GDN layers)
    v_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    conv_kernel: int = 4

    @classmethod
    def of_target(cls, cfg: dict) -> Dims:
        rope = cfg.get("rope_parameters") or {}
        return cls(cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["num_attention_heads"],
                   cfg["num_key_value_heads"], cfg["head_dim"],
                   rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)),
                   cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                   cfg["linear_value_head_dim"], cfg.get("linear_conv_kernel_dim", 4))

    @classmethod
    def of_dflash(cls, cfg: dict) -> Dims:
        return cls(cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["num_attention_heads"],
                   cfg["num_key_value_heads"], cfg["head_dim"], 1.0)


# Wide shapes: (target, DFlash drafter). The 9B target is Qwen3.5-9B's text config
# (scripts/shaped_checkpoint.py); `test` is small enough for a CPU test; `mid` is a second held-out
# target for the controller on the dev CPU. (Qwen3.5-0.8B has one GDN value head a key head where
# the bundled target has two: a value head could not keep its key head without copying key heads,
# which this script does not do.)
SHAPES = {
    "9b": (Dims(4096, 32, 12288, 16, 4, 256, 0.25, 16, 32, 128, 128), Dims(4096, 2, 12288, 32, 8, 128, 1.0)),
    "test": (Dims(512, 12, 1024, 8, 2, 128, 0.25, 8, 16, 64, 64), Dims(512, 2, 1024, 8, 2, 128, 1.0)),
    "mid": (Dims(1024, 16, 2048, 8, 2, 128, 0.25, 8, 16, 64, 64), Dims(1024, 2, 2048, 8, 2, 128, 1.0)),
}


# ---------------------------------------------------------------------------------------------
# Index maps: where a small row / column goes in the wide matrix


def rotated(head_dim: int, share: float) -> int:
    return int(head_dim * share)


def head_dim_map(small: int, wide: int, r_small: int, r_wide: int) -> np.ndarray:
    """Wide index of each dim of a small head: rotated pair i -> pair i * r_wide / r_small (same
    frequency), the unrotated dims after the wide head's rotated ones."""
    if r_wide % r_small or small - r_small > wide - r_wide:
        raise ValueError(f"cannot place a {small}-dim head ({r_small} rotated) in a {wide}-dim one ({r_wide})")
    step, hs, hw = r_wide // r_small, r_small // 2, r_wide // 2
    i = np.arange(hs)
    return np.concatenate([i * step, i * step + hw, r_wide + np.arange(small - r_small)])


def query_head_map(heads: int, kv: int, wide_heads: int, wide_kv: int) -> np.ndarray:
    """Query head h reads K/V head h // G; in the wide model it must read the same (wide) K/V head."""
    g, wg = heads // kv, wide_heads // wide_kv
    if g > wg or kv > wide_kv:
        raise ValueError(f"cannot place {heads} query heads over {kv} K/V heads in {wide_heads} over {wide_kv}")
    h = np.arange(heads)
    return (h // g) * wg + h % g


def blocks(heads: np.ndarray, width: int, inner: np.ndarray) -> np.ndarray:
    """Flat indices of `inner` dims inside each of `heads` blocks of `width`."""
    return (heads[:, None] * width + inner[None, :]).reshape(-1)


@dataclass(frozen=True)
class Plan:
    """The index maps of one small -> wide widening."""

    small: Dims
    wide: Dims

    @property
    def hidden(self) -> np.ndarray:
        return np.arange(self.small.hidden)

    @property
    def units(self) -> np.ndarray:  # MLP intermediate
        return np.arange(self.small.intermediate)

    @property
    def dim_map(self) -> np.ndarray:
        s, w = self.small, self.wide
        return head_dim_map(s.head_dim, w.head_dim, rotated(s.head_dim, s.rotary), rotated(w.head_dim, w.rotary))

    @property
    def q_heads(self) -> np.ndarray:
        s, w = self.small, self.wide
        return query_head_map(s.heads, s.kv_heads, w.heads, w.kv_heads)

    def q_rows(self, gated: bool) -> tuple[np.ndarray, np.ndarray]:
        """(wide rows of the small q_proj's rows, wide rows of every real head): with an output gate,
        each head's rows are [query | gate]."""
        width = self.wide.head_dim * (2 if gated else 1)
        d = self.dim_map
        if gated:  # a small head's rows are its head_dim query rows, then its head_dim gate rows
            inner = np.concatenate([d, self.wide.head_dim + d])
        else:
            inner = d
        return blocks(self.q_heads, width, inner), blocks(self.q_heads, width, np.arange(width))

    def kv_rows(self) -> tuple[np.ndarray, np.ndarray]:
        heads = np.arange(self.small.kv_heads)
        return blocks(heads, self.wide.head_dim, self.dim_map), blocks(heads, self.wide.head_dim,
                                                                      np.arange(self.wide.head_dim))

    def o_cols(self) -> np.ndarray:
        return blocks(self.q_heads, self.wide.head_dim, self.dim_map)

    # GDN: conv channels are [q (Hk x Dk) | k (Hk x Dk) | v (Hv x Dv)]
    def gdn_maps(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """name -> (wide indices of the small ones, wide indices of every real head's dims)."""
        s, w = self.small, self.wide
        if s.v_heads // s.k_heads != w.v_heads // w.k_heads:
            raise ValueError("GDN value heads per key head must match (a value head keeps its key head)")
        if s.k_heads > w.k_heads or s.k_dim > w.k_dim or s.v_dim > w.v_dim:
            raise ValueError("the wide GDN layer is smaller than the small one")
        kh, vh = np.arange(s.k_heads), np.arange(s.v_heads)
        q = blocks(kh, w.k_dim, np.arange(s.k_dim)), blocks(kh, w.k_dim, np.arange(w.k_dim))
        k = tuple(x + w.k_heads * w.k_dim for x in q)
        v = tuple(x + 2 * w.k_heads * w.k_dim for x in (blocks(vh, w.v_dim, np.arange(s.v_dim)),
                                                        blocks(vh, w.v_dim, np.arange(w.v_dim))))
        return {"conv": tuple(np.concatenate(p) for p in zip(q, k, v, strict=True)),
                "value": (blocks(vh, w.v_dim, np.arange(s.v_dim)), blocks(vh, w.v_dim, np.arange(w.v_dim)))}
