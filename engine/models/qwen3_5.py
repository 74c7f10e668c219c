"""Qwen3.5 / Qwen3.6 dense hybrid: Gated DeltaNet layers with a gated-attention layer every
`full_attention_interval` layers (layer i is attention iff (i+1) % interval == 0).

Parameter names mirror the HF checkpoint (`model.layers.N.linear_attn.in_proj_qkv.weight`, ...),
so the loader only strips prefixes. The model maps (tokens, cache, tree) -> logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine import gdn, gdn_tree
from engine.cache import GDNCache, GDNPending, KVCache, LayerCache
from engine.models.layers import MLP, Attention, RMSNorm, RopeSpec, TreeBatch


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float
    partial_rotary_factor: float
    layer_is_attention: tuple[bool, ...]
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        """cfg: the text config (nested text_config already merged by the loader)."""
        n = cfg["num_hidden_layers"]
        if "layer_types" in cfg:
            is_attn = tuple(t == "full_attention" for t in cfg["layer_types"])
        else:
            every = cfg.get("full_attention_interval", 4)
            is_attn = tuple((i + 1) % every == 0 for i in range(n))
        return cls(
            **decoder_fields(cfg, default_theta=1e7, default_rotary=0.25),
            layer_is_attention=is_attn,
            linear_num_key_heads=cfg["linear_num_key_heads"],
            linear_num_value_heads=cfg["linear_num_value_heads"],
            linear_key_head_dim=cfg["linear_key_head_dim"],
            linear_value_head_dim=cfg["linear_value_head_dim"],
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
        )


def decoder_fields(cfg: dict, default_theta: float, default_rotary: float) -> dict:
    """The ModelArgs fields every decoder family reads the same way."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    heads = cfg["num_attention_heads"]
    return dict(
        model_type=cfg["model_type"],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", default_theta))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                             cfg.get("partial_rotary_factor", default_rotary))),
    )


class DepthwiseConv(nn.Module):
    """Holds the short-conv weight as [C, K] (HF stores [C, 1, K], mlx-lm [C, K, 1])."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = mx.zeros((channels, kernel))


class GatedRMSNorm(nn.Module):
    """rmsnorm(o) * weight * silu(z), in fp32. This norm is not zero-centred."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, o: mx.array, z: mx.array) -> mx.array:
        o = mx.fast.rms_norm(o.astype(mx.float32), self.weight.astype(mx.float32), self.eps)
        z = z.astype(mx.float32)
        return o * (z * mx.sigmoid(z))


class GatedDeltaNet(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.Hk, self.Hv = a.linear_num_key_heads, a.linear_num_value_heads
        self.Dk, self.Dv = a.linear_key_head_dim, a.linear_value_head_dim
        self.key_dim, self.value_dim = self.Hk * self.Dk, self.Hv * self.Dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.K = a.linear_conv_kernel_dim
        H = a.hidden_size
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.Hv, bias=False)
        self.in_proj_a = nn.Linear(H, self.Hv, bias=False)
        self.conv1d = DepthwiseConv(self.conv_dim, self.K)
        self.A_log = mx.zeros((self.Hv,))
        self.dt_bias = mx.ones((self.Hv,))
        self.norm = GatedRMSNorm(self.Dv, a.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)

    def _split_heads(self, y: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Post-conv rows [T, C] -> q, k [T, Hv, Dk] (normalised, repeated) and v [T, Hv, Dv]."""
        T = y.shape[0]
        q = y[:, : self.key_dim].reshape(T, self.Hk, self.Dk)
        k = y[:, self.key_dim : 2 * self.key_dim].reshape(T, self.Hk, self.Dk)
        v = y[:, 2 * self.key_dim :].reshape(T, self.Hv, self.Dv).astype(mx.float32)
        q = gdn.l2norm(q) * (self.Dk**-0.5)
        k = gdn.l2norm(k)
        if self.Hv != self.Hk:
            q = mx.repeat(q, self.Hv // self.Hk, axis=1)
            k = mx.repeat(k, self.Hv // self.Hk, axis=1)
        return q, k, v

    def initial_state(self, cache: GDNCache, dtype) -> tuple[mx.array, mx.array]:
        if cache.state is None:
            cache.conv_state = mx.zeros((1, self.K - 1, self.conv_dim), dtype)
            cache.state = mx.zeros((1, self.Hv, self.Dv, self.Dk), mx.float32)
        return cache.conv_state[0], cache.state[0]

    def token(self, x: mx.array, conv_state: mx.array, S0: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """One token, pure (compilable): x [1, 1, H] -> (out [1, 1, H], new conv state, new state)."""
        qkv = self.in_proj_qkv(x)[0]
        z = self.in_proj_z(x)[0].reshape(1, self.Hv, self.Dv)
        g, beta = gdn.gates(self.in_proj_a(x)[0], self.in_proj_b(x)[0], self.A_log, self.dt_bias)
        y, new_conv = gdn.causal_conv(qkv, conv_state, self.conv1d.weight)
        q, k, v = self._split_heads(y)
        o, S = gdn.gdn_step(q[0], k[0], v[0], g[0], beta[0], S0)
        out = self.norm(o[None], z).astype(x.dtype).reshape(1, 1, -1)
        return self.out_proj(out), new_conv, S

    def tree_rows(self, x: mx.array, conv_state: mx.array, S0: mx.array, taps: mx.array,
                  masks: gdn_tree.TreeMasks) -> tuple[mx.array, ...]:
        """N tree rows, pure (compilable): x [1, N, H] -> (out [1, N, H], and for the commit:
        pre-conv rows [N, C], k [N, Hv, Dk], innovations u [N, Hv, Dv], log-decays g [N, Hv])."""
        N = x.shape[1]
        qkv = self.in_proj_qkv(x)[0]
        z = self.in_proj_z(x)[0].reshape(N, self.Hv, self.Dv)
        g, beta = gdn.gates(self.in_proj_a(x)[0], self.in_proj_b(x)[0], self.A_log, self.dt_bias)
        y = gdn_tree.tree_conv(qkv, None, conv_state, self.conv1d.weight, taps)
        q, k, v = self._split_heads(y)
        o, u = gdn_tree.gdn_tree_dense(q, k, v, g, beta, masks, S0)
        out = self.norm(o, z).astype(x.dtype).reshape(1, N, -1)
        return self.out_proj(out), qkv, k, u, g

    def __call__(self, x: mx.array, cache: GDNCache, tree: TreeBatch | None) -> mx.array:
        conv_state, S0 = self.initial_state(cache, x.dtype)
        if x.shape[1] == 1:
            out, new_conv, S = self.token(x, conv_state, S0)
            store(cache, tree, new_conv, S)
            return out
        if tree is not None:
            out, qkv, k, u, g = self.tree_rows(x, conv_state, S0, tree.conv_taps, tree.gdn_masks)
            cache.pending = GDNPending(x=qkv, k=k, u=u, g=g)
            return out
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)[0]
        z = self.in_proj_z(x)[0].reshape(T, self.Hv, self.Dv)
        g, beta = gdn.gates(self.in_proj_a(x)[0], self.in_proj_b(x)[0], self.A_log, self.dt_bias)
        y, new_conv = gdn.causal_conv(qkv, conv_state, self.conv1d.weight)
        q, k, v = self._split_heads(y)
        o, S = gdn.gdn_chain(q, k, v, g, beta, S0)
        cache.conv_state, cache.state = new_conv[None], S[None]
        out = self.norm(o, z).astype(x.dtype).reshape(B, T, -1)
        return self.out_proj(out)


def store(cache: GDNCache, tree: TreeBatch | None, conv_state: mx.array, S: mx.array) -> None:
    """A chain token is written at once; a one-node tree waits for its commit."""
    if tree is None:
        cache.conv_state, cache.state = conv_state[None], S[None]
    else:
        cache.pending = GDNPending(single=(conv_state, S))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, is_attention: bool) -> None:
        super().__init__()
        self.is_attention = is_attention
        if is_attention:
            rope = RopeSpec(int(a.head_dim * a.partial_rotary_factor), a.rope_theta)
            self.self_attn = Attention(a.hidden_size, a.num_attention_heads, a.num_key_value_heads,
                                       a.head_dim, a.rms_norm_eps, rope, output_gate=True)
        else:
            self.linear_attn = GatedDeltaNet(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)

    def __call__(self, x: mx.array, cache: LayerCache, tree: TreeBatch | None) -> mx.array:
        if self.compiled and (tree is not None or x.shape[1] == 1):
            return self._compiled_forward(x, cache, tree)
        mixer = self.self_attn if self.is_attention else self.linear_attn
        h = x + mixer(self.input_layernorm(x), cache, tree)
        return h + self.mlp(self.post_attention_layernorm(h))

    # Decoding (a one-token step or a tree verify) is where per-op overhead dominates: the same
    # code as above, split at the cache into pure parts that mx.compile fuses (one trace per
    # row count). Chain prefill keeps the plain path.
    compiled = True

    def _compiled_forward(self, x: mx.array, cache: LayerCache, tree: TreeBatch | None) -> mx.array:
        if not hasattr(self, "_fns"):
            self._fns = self._compile_fns()
        if self.is_attention:
            pre, post = self._fns
            q, k, v, *gate = pre(x)
            return post(x, self.self_attn.attend(q, k, v, cache, tree), *gate)
        token_fn, tree_fn = self._fns
        conv_state, S0 = self.linear_attn.initial_state(cache, x.dtype)
        if x.shape[1] == 1:
            out, new_conv, S = token_fn(x, conv_state, S0)
            store(cache, tree, new_conv, S)
            return out
        m = tree.gdn_masks
        out, qkv, k, u, g = tree_fn(x, conv_state, S0, tree.conv_taps, m.incl, m.strict, m.incl_f32, m.max_depth)
        cache.pending = GDNPending(x=qkv, k=k, u=u, g=g)
        return out

    def _compile_fns(self):
        def finish(h):
            return h + self.mlp(self.post_attention_layernorm(h))

        if not self.is_attention:
            gdn_layer = self.linear_attn

            def token(x, conv_state, S0):
                o, new_conv, S = gdn_layer.token(self.input_layernorm(x), conv_state, S0)
                return finish(x + o), new_conv, S

            def rows(x, conv_state, S0, taps, incl, strict, incl_f32, max_depth):
                masks = gdn_tree.TreeMasks(incl, strict, incl_f32, max_depth)
                o, *rest = gdn_layer.tree_rows(self.input_layernorm(x), conv_state, S0, taps, masks)
                return (finish(x + o), *rest)

            return mx.compile(token), mx.compile(rows)
        attn = self.self_attn

        def post(x, out, gate=None):
            return finish(x + attn.output(out, gate))

        return mx.compile(lambda x: attn.project(self.input_layernorm(x))), mx.compile(post)


class TextModel(nn.Module):
    def __init__(self, a: ModelArgs, layer_cls=DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [layer_cls(a, is_attn) for is_attn in a.layer_is_attention]
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def __call__(self, tokens: mx.array, cache: list[LayerCache], tree: TreeBatch | None) -> mx.array:
        h = self.embed_tokens(tokens)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c, tree)
        return self.norm(h)


class Model(nn.Module):
    """Causal LM: tokens [1, T] -> logits [1, T, V] (or [1, 1, V] with last_only)."""

    # Norms stored zero-centred in HF checkpoints (applied as 1 + w): the loader adds 1.
    zero_centred_norms = ("input_layernorm.weight", "post_attention_layernorm.weight",
                          "model.norm.weight", "q_norm.weight", "k_norm.weight")

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = TextModel(args, self.layer_class())
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @staticmethod
    def layer_class():
        return DecoderLayer

    def make_cache(self) -> list[LayerCache]:
        return [KVCache() if attn else GDNCache() for attn in self.args.layer_is_attention]

    def hidden(self, tokens: mx.array, cache: list[LayerCache], tree: TreeBatch | None = None) -> mx.array:
        return self.model(tokens, cache, tree)

    def logits(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(self, tokens: mx.array, cache: list[LayerCache], tree: TreeBatch | None = None,
                 last_only: bool = False) -> mx.array:
        h = self.hidden(tokens, cache, tree)
        return self.logits(h[:, -1:] if last_only else h)
