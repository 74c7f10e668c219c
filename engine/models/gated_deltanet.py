"""A Qwen3.5 Gated DeltaNet mixer: the fused input projections, the short conv and the recurrent
core (engine/gdn/core.py: plain ops, the CPU's own operations or the GPU kernels), the gated output
norm and the output projection. Parameter names mirror the HF checkpoint's `linear_attn.*`."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine import cpu_exp, cpu_ext, fused_norms
from engine.cache import GDNCache
from engine.gdn.core import Fold, GDNCore, GDNShape, GDNWeights, TreeInputs, TreeRows
from engine.gdn.ops import ConvViews
from engine.kernels import gated_step_applies
from engine.models import fused_qmm
from engine.models.base import ModelArgs
from engine.models.fused import fuse_into
from engine.models.layers import Batch, Mode, norm_then
from engine.models.linear import Linear


def gdn_shape(a: ModelArgs) -> GDNShape:
    return GDNShape(a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                    a.linear_value_head_dim, a.linear_conv_kernel_dim)


class DepthwiseConv(nn.Module):
    """Holds the short-conv weight as [C, K] (HF stores [C, 1, K], mlx-lm [C, K, 1]), and, once the
    weights are final (engine/models/linear.py `hold_views`), its views that the plain-ops convolutions read
    (engine/gdn/ops.py ConvViews: fewer graph nodes a step on the CPU, the same bits)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = mx.zeros((channels, kernel))

    @property
    def views(self) -> ConvViews | None:
        # a plain attribute, not a parameter (nn.Module keeps arrays and containers of them as
        # parameters; ConvViews is neither), checked against the weight it was made of
        views: ConvViews | None = getattr(self, "_views", None)
        return views if views is not None and views.weight is self["weight"] else None

    def hold_views(self) -> None:
        """Make (again) the views of the weight: outside any traced function."""
        self._views = ConvViews.of(self["weight"])


class GatedRMSNorm(nn.Module):
    """rmsnorm(o) * weight * silu(z), in fp32. This norm is not zero-centred."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, o: mx.array, z: mx.array) -> mx.array:
        o = cpu_ext.rms_norm(o.astype(mx.float32), self.weight.astype(mx.float32), self.eps)
        z = z.astype(mx.float32)
        return o * cpu_exp.silu(z)


class GatedDeltaNet(nn.Module):
    """Input projections -> recurrent core (engine/gdn/core.py) -> gated norm -> output projection."""

    def __init__(self, a: ModelArgs, core: GDNCore) -> None:
        super().__init__()
        self.shape = gdn_shape(a)
        self.core = core
        s, H = self.shape, a.hidden_size
        self.in_proj_qkv = Linear(H, s.conv_dim, bias=False)
        self.in_proj_z = Linear(H, s.value_dim, bias=False)
        self.in_proj_b = Linear(H, s.Hv, bias=False)
        self.in_proj_a = Linear(H, s.Hv, bias=False)
        self.conv1d = DepthwiseConv(s.conv_dim, s.K)
        self.A_log = mx.zeros((s.Hv,))
        self.dt_bias = mx.ones((s.Hv,))
        self.norm = GatedRMSNorm(s.Dv, a.rms_norm_eps)
        self.out_proj = Linear(s.value_dim, H, bias=False)

    def forward(self, mode: Mode, x: mx.array, conv_state: mx.array, S: mx.array, tree: tuple[mx.array, ...],
                levels: int, fold: tuple[mx.array, ...] = (), gated_kernel: bool = False,
                norm: fused_qmm.Norm | None = None,
                residual: mx.array | None = None) -> tuple[mx.array, tuple[mx.array, ...]]:
        """Pure (compilable): x [1, T, H] -> (out [1, T, H], what the cache keeps: the new
        (conv state, state) for a token or a chain, the TreeRows fields for a tree, followed by
        the states after `fold` (Fold's arrays: the last commit, run inside this verify) if given).
        gated_kernel: the output norm and gate in one launch (engine/fused_norms.py, opt-in).
        norm: applied to x first; residual: added to out (each in the projection's launch where
        engine/models/fused_qmm.py's builds run)."""
        s, T = self.shape, x.shape[1]
        # the products of one [T, H] view: of x [1, T, H], each product flattened its input,
        # unflattened its output and was squeezed, graph nodes that the CPU evaluates at a few µs
        # each and the GPU's host encodes one by one (the same GEMM on the same rows either way)
        flat = x.reshape(T, -1)
        if "fused" in self:
            qkv, z, b, a = fused_qmm.project(self.fused, flat, norm=norm)
        else:
            qkv, z, b, a = norm_then(flat, [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a], norm)
        w = GDNWeights(self.conv1d.weight, self.A_log, self.dt_bias, self.conv1d.views)
        result: tuple[mx.array, ...]
        if mode == "tree" and fold:
            o, rows, conv_state, S = self.core.tree_after(s, w, qkv, a, b, conv_state, S,
                                                          TreeInputs.from_arrays(tree, levels), Fold.from_arrays(fold))
            result = (rows.x, rows.k, rows.u, rows.g, conv_state, S)
        elif mode == "tree":
            o, rows = self.core.tree(s, w, qkv, a, b, conv_state, S, TreeInputs.from_arrays(tree, levels))
            result = (rows.x, rows.k, rows.u, rows.g)
        elif (mode == "token" and gated_kernel
              and gated_step_applies(self.core, s, qkv, conv_state, z, self.norm.weight)):
            # the step and the gated norm in one launch, the bits of the two below
            out, conv_state, S = self.core.step_gated(s, w, qkv, a, b, conv_state, S, z, self.norm.weight,
                                                      self.norm.eps)
            return self._project(out, residual), (conv_state, S)
        else:
            run = self.core.step if mode == "token" else self.core.chain
            o, conv_state, S = run(s, w, qkv, a, b, conv_state, S)
            result = (conv_state, S)
        if gated_kernel and fused_norms.gated_covers(o, z, self.norm.weight):
            out = fused_norms.gated_norm(o, z, self.norm.weight, self.norm.eps)
        else:
            out = self.norm(o, z.reshape(T, s.Hv, s.Dv)).astype(x.dtype).reshape(1, T, -1)
        return self._project(out, residual), result

    def _project(self, out: mx.array, residual: mx.array | None) -> mx.array:
        """out_proj(out), plus the residual in the projection's launch where one is given."""
        if residual is not None:
            return fused_qmm.linear_res(self.out_proj, out, residual)
        return self.out_proj(out)

    def fuse_projections(self) -> bool:
        return fuse_into(self, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))

    @staticmethod
    def store(cache: GDNCache, batch: Batch, mode: Mode, result: tuple[mx.array, ...], rows: int) -> None:
        """A chain's states replace the committed ones; a verify's wait for the commit (and a verify
        that folded the last commit in leaves the states after it)."""
        if mode == "tree":
            if len(result) > 4:  # (conv state, state) after the last commit, which this verify folded in
                cache.settle_with(result[4], result[5])
            cache.defer(TreeRows(*result[:4]))
        elif batch.deferred:
            conv_state, S = result
            cache.defer((conv_state, S))
        else:
            conv_state, S = result
            cache.write(conv_state, S, rows)
