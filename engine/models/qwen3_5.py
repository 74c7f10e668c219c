"""Qwen3.5 / Qwen3.6 dense hybrid: Gated DeltaNet layers with a gated-attention layer every
`full_attention_interval` layers (layer i is attention iff (i+1) % interval == 0). The GDN mixer
is engine/models/gated_deltanet.py.

Parameter names mirror the HF checkpoint (`model.layers.N.linear_attn.in_proj_qkv.weight`, ...),
so the loader only strips prefixes. The model maps (tokens, cache, batch) -> logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine import cpu_exp, cpu_ext, fused_norms, launch_plan, layer_plans
from engine.cache import GDNCache, KVCache, LayerCache
from engine.feature_cache import FeatureCache
from engine.gdn.core import GDNCore
from engine.kernels import GATED_STEP, select_gdn_core
from engine.models import fused_qmm, segments
from engine.models.base import ModelArgs, decoder_fields
from engine.models.gated_deltanet import GatedDeltaNet, gdn_shape
from engine.models.layers import CHAIN, MLP, Attention, Batch, Mode, RMSNorm, RopeSpec, cpu_mlp
from engine.models.linear import Linear
from engine.models.segments import Pending, split, with_pending


def args_from_config(cfg: dict[str, Any]) -> ModelArgs:
    """cfg: the text config (nested text_config already merged by the loader)."""
    n = cfg["num_hidden_layers"]
    if "layer_types" in cfg:
        is_attn = tuple(t == "full_attention" for t in cfg["layer_types"])
    else:
        every = cfg.get("full_attention_interval", 4)
        is_attn = tuple((i + 1) % every == 0 for i in range(n))
    return ModelArgs(
        **decoder_fields(cfg, default_theta=1e7, default_rotary=0.25),
        layer_is_attention=is_attn,
        linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"],
        linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"],
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
    )


def tree_arrays(batch: Batch) -> tuple[mx.array, ...]:
    """The per-tree GDN inputs as a flat tuple of arrays (what a compiled function can take)."""
    return () if batch.gdn is None else batch.gdn.arrays()


# what a layer's traced functions depend on: (mode, compiled, folding, fused add + norm, fused gated
# norm, the CPU's gates through 2^, projections fused with the residual adds after them, and with
# the norms and SwiGLU before them: fused_qmm.wiring(), a GDN layer's token step, its tree verify,
# the RMS norms and the MLP block, in the CPU's own operations: cpu_ext.GDN_STEP, cpu_ext.GDN_TREE,
# cpu_ext.NORMS, cpu_ext.MLP, and the input norm with the mixer's projections in one:
# cpu_ext.PRODUCTS; the launch-plan wiring, and its attention layers'; a token's GDN step with its
# gated norm in one launch: kernels.GATED_STEP; an output of the last layer pending)
TraceKey = tuple[object, ...]


def trace_settings() -> tuple[bool, ...]:
    """The module settings a layer's traced functions depend on (a TraceKey's fields after the
    mode, the compilation and the folding, but for the last layer's output pending)."""
    return (*fused_norms.traces(), cpu_exp.POW_GATES, *fused_qmm.wiring(), cpu_ext.GDN_STEP, cpu_ext.GDN_TREE,
            cpu_ext.NORMS, cpu_ext.MLP, cpu_ext.PRODUCTS, launch_plan.enabled(), layer_plans.ATTENTION.enabled(),
            GATED_STEP.enabled())


class _Phases:
    """A layer's functions per mode, built once (compiled for decoding), and its decode step's
    launch plans per activation dtype (engine/layer_plans.py: a GDN layer's one, an attention
    layer's two; None where they do not apply)."""

    def __init__(self) -> None:
        self.by_mode: dict[TraceKey, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self.plans: dict[mx.Dtype, launch_plan.LaunchPlan | layer_plans.AttentionPlans | None] = {}


class DecoderLayer(nn.Module):
    """Pre-norm mixer (attention or GDN) + pre-norm MLP, both residual.

    A layer runs as pure functions around one cache access: attention projects, attends through
    its KV cache, then outputs; GDN reads its states, computes the whole layer, then stores what
    the cache keeps. Decoding (one token, a tree) is where per-op overhead dominates, so there the
    pure functions are compiled (one trace per row count); a chain (prefill) runs them plain.
    """

    compile_decode = True  # class-wide switch: tests flip it to hold the compiled path to the plain one
    attention_output_gate = True  # Qwen3.5 gates the attention output; Qwen3 does not

    def __init__(self, a: ModelArgs, is_attention: bool, core: GDNCore) -> None:
        super().__init__()
        self.is_attention = is_attention
        if is_attention:
            rope = RopeSpec(int(a.head_dim * a.partial_rotary_factor), a.rope_theta)
            self.self_attn = Attention(a.hidden_size, a.num_attention_heads, a.num_key_value_heads,
                                       a.head_dim, a.rms_norm_eps, rope, self.attention_output_gate)
        else:
            self.linear_attn = GatedDeltaNet(a, core)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        self._phases = _Phases()

    def __call__(self, x: mx.array, cache: LayerCache, batch: Batch) -> mx.array:
        h, pending = self.chained(x, (), cache, batch)
        return with_pending(h, pending)

    def chained(self, x: mx.array, pending: Pending, cache: LayerCache, batch: Batch) -> tuple[mx.array, Pending]:
        """The layer on the residual stream x + pending (pending: the last layer's MLP output, not
        added yet, or nothing) -> the stream after it, as (h, pending). With the residual adds
        fused into the norms after them (engine/fused_norms.py), the MLP's output is left pending,
        so that the next layer adds it in the launch of its input norm."""
        mode = batch.mode(x.shape[1])
        before, after = self._functions(mode, chained=bool(pending))
        if self.is_attention:
            assert isinstance(cache, KVCache)
            x, q, k, v, *gate = before(x, pending)
            return split(after(x, self.self_attn.attend(q, k, v, cache, batch), *gate))
        assert isinstance(cache, GDNCache)
        levels = 0 if batch.gdn is None else batch.gdn.levels
        if mode == "tree":
            conv_state, S, fold = cache.fold_states(x.dtype)
        else:
            (conv_state, S), fold = cache.states(x.dtype), None
        if fold is not None:
            before, after = self._functions(mode, folding=True, chained=bool(pending))
        h, result = before(x, pending, conv_state, S, tree_arrays(batch), levels,
                           *(() if fold is None else (fold.arrays(),)))
        self.linear_attn.store(cache, batch, mode, result, x.shape[1])
        return split(after(h))

    def _functions(self, mode: Mode, folding: bool = False,
                   chained: bool = False) -> tuple[Callable[..., Any], Callable[..., Any]]:
        compiled = self.compile_decode and mode != "chain"
        # a trace per setting of the fused norms and of the CPU's gates (engine/cpu_exp.py), and
        # per input (the stream alone, or with the last layer's output pending)
        key: TraceKey = (mode, compiled, folding, *trace_settings(), chained)
        if key not in self._phases.by_mode:
            before, after = self._pure_functions(mode)
            if compiled:
                before, after = mx.compile(before), mx.compile(after)
            self._phases.by_mode[key] = (before, after)
        return self._phases.by_mode[key]

    def prepare_plan(self, dtype: mx.Dtype) -> None:
        """Record this layer's decode-step plans for rows of `dtype` if not done yet (outside any
        traced function: a recording evaluates the plan's workspace and constants). An attention
        layer's are recorded once its plans are switched on (layer_plans.ATTENTION): their kernels
        are compiled at the first step, which is start-up time spent for nothing while they are off."""
        if dtype in self._phases.plans or (self.is_attention and not layer_plans.ATTENTION.enabled()):
            return
        self._phases.plans[dtype] = layer_plans.plan_for(self, dtype)

    def token_functions(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The one-token pure functions, uncompiled: what a segment of a one-token pass traces
        (engine/models/segments.py)."""
        return self._pure_functions("token")

    def _pure_functions(self, mode: Mode) -> tuple[Callable[..., Any], Callable[..., Any]]:
        fused, gated = fused_norms.traces()
        if mode != "chain" and fused_qmm.wiring()[0]:
            return self._qmm_fused_functions(mode, gated)

        def start(x: mx.array, pending: Pending) -> tuple[mx.array, mx.array]:
            """(the residual stream, its input norm): the last layer's output added first."""
            if not pending:
                return x, self.input_layernorm(x)
            return residual_norm(x, pending[0], self.input_layernorm, fused)

        one_block = not fused and mode != "chain" and cpu_mlp(self.mlp, self.post_attention_layernorm)

        def finish(x: mx.array, out: mx.array) -> tuple[mx.array, ...]:
            """The residual add of the mixer's output, then the MLP on its norm -> the stream, with
            the MLP's output added, or left pending where the adds are fused."""
            if one_block and cpu_ext.serves(True, x, out):
                # one operation of the engine's own for ~11 graph nodes (engine/cpu_ext.cpp): a
                # decode step's and a verify's rows alike
                mlp, norm = self.mlp, self.post_attention_layernorm
                return (cpu_ext.mlp_block(x, out, norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                                          mlp.down_proj.weight, norm.eps),)
            h, normed = residual_norm(x, out, self.post_attention_layernorm, fused)
            m = self.mlp(normed)
            return (h, m) if fused else (h + m,)

        # the input norm inside the mixer's projections' operation (layers.norm_then) where nothing
        # is pending: one CPU operation for the norm and its products
        norm_inside = not fused and cpu_ext.PRODUCTS

        if self.is_attention:
            attn = self.self_attn

            def project(x: mx.array, pending: Pending) -> list[mx.array]:
                if norm_inside and not pending:
                    return [x, *attn.project(x, norm=self.input_layernorm)]
                x, normed = start(x, pending)
                return [x, *attn.project(normed)]

            def output(x: mx.array, out: mx.array, gate: mx.array | None = None) -> tuple[mx.array, ...]:
                return finish(x, attn.output(out, gate))

            return project, output
        gdn = self.linear_attn

        def layer(x: mx.array, pending: Pending, conv_state: mx.array, S: mx.array, tree: tuple[mx.array, ...],
                  levels: int, fold: tuple[mx.array, ...] = ()):
            if norm_inside and not pending:
                out, result = gdn.forward(mode, x, conv_state, S, tree, levels, fold, gated, norm=self.input_layernorm)
            else:
                x, normed = start(x, pending)
                out, result = gdn.forward(mode, normed, conv_state, S, tree, levels, fold, gated)
            return finish(x, out), result

        return layer, _identity

    def _qmm_fused_functions(self, mode: Mode, gated: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The layer with each norm in the launch of the projection after it and each residual add
        in the launch of the projection before it (engine/models/fused_qmm.py): no output is left
        pending, and none comes in (every decode layer of a model is wired alike). Where a build does
        not cover a projection, the same ops run unfused."""
        norm, post, mlp = self.input_layernorm, self.post_attention_layernorm, self.mlp
        # the launch-plan wiring (engine/launch_plan.py): a layer's norms, SwiGLU and (attention)
        # head norms and output gate through the engine's own kernels, so that its decode step runs
        # as plans and a verify's rows run the plans' kernels one by one
        planned = mode != "chain" and launch_plan.enabled()
        plans = self._phases.plans

        if self.is_attention:
            attn = self.self_attn
            kernels = layer_plans.of_attention_decoder(self) if planned and layer_plans.ATTENTION.enabled() else None

            def wired(x: mx.array) -> layer_plans.AttentionLayer | None:
                """The layer's launch-plan kernels where they cover these rows, else None."""
                if kernels is None or not layer_plans.attention_covers(kernels, x.shape[1], x.shape[2], x.dtype):
                    return None
                return kernels

            def project(x: mx.array, pending: Pending) -> list[mx.array]:
                assert not pending, "no layer of this wiring leaves its output pending"
                layer = wired(x)
                if layer is None:
                    return [x, *attn.project(x, norm)]
                plan = plans.get(x.dtype) if mode == "token" else None
                if isinstance(plan, layer_plans.AttentionPlans) and plan.project.accepts(x):
                    return [x, *plan.project(x)]  # three launches recorded once
                return [x, *layer_plans.attention_project_rows(layer, x)]

            def output(x: mx.array, out: mx.array, gate: mx.array | None = None) -> tuple[mx.array, ...]:
                layer = wired(x)
                if layer is None or gate is None:
                    return (fused_qmm.mlp_residual(mlp, attn.output(out, gate, residual=x), post),)
                plan = plans.get(x.dtype) if mode == "token" else None
                if isinstance(plan, layer_plans.AttentionPlans) and plan.output.accepts(x, out, gate):
                    return (plan.output(x, out, gate)[0],)  # six launches recorded once
                return (layer_plans.attention_output_rows(layer, x, out, gate),)

            return project, output
        gdn = self.linear_attn
        in_norm: fused_qmm.Norm = fused_qmm.KernelNorm(norm) if planned else norm
        post_norm: fused_qmm.Norm = fused_qmm.KernelNorm(post) if planned else post

        def layer(x: mx.array, pending: Pending, conv_state: mx.array, S: mx.array, tree: tuple[mx.array, ...],
                  levels: int, fold: tuple[mx.array, ...] = ()):
            assert not pending, "no layer of this wiring leaves its output pending"
            plan = plans.get(x.dtype) if planned and mode == "token" else None
            if isinstance(plan, launch_plan.LaunchPlan) and plan.accepts(x, conv_state, S):
                # the whole layer as one operation: the launches below, recorded once
                out, conv_state, S = plan(x, conv_state, S)
                return (out,), (conv_state, S)
            h, result = gdn.forward(mode, x, conv_state, S, tree, levels, fold, gated, norm=in_norm, residual=x)
            return (fused_qmm.mlp_residual(mlp, h, post_norm, planned),), result

        return layer, _identity


def residual_norm(x: mx.array, y: mx.array, norm: RMSNorm, fused: bool) -> tuple[mx.array, mx.array]:
    """(h, norm(h)) with h = x + y: one launch where the fused add and norm cover the rows."""
    if fused and fused_norms.add_covers(x, y, norm.weight):
        return fused_norms.add_norm(x, y, norm.weight, norm.eps)
    h = x + y
    return h, norm(h)


def _identity(h: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
    return h


class TextModel(nn.Module):
    def __init__(self, a: ModelArgs, layer_cls: type[DecoderLayer], core: GDNCore) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [layer_cls(a, is_attn, core) for is_attn in a.layer_is_attention]
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self._segments = segments.Segments(a.layer_is_attention)

    def __call__(self, tokens: mx.array, cache: list[LayerCache], batch: Batch) -> mx.array:
        """A FeatureCache after the layer caches records the hidden states it taps (DFlash, MTP), in
        layer order, then the final-normed state."""
        features = cache[-1] if len(cache) == len(self.layers) + 1 else None
        assert features is None or isinstance(features, FeatureCache)
        taps = features.taps.layers if features is not None else ()
        h = self.embed_tokens(tokens)
        tapped: list[mx.array] = []
        pending: Pending = ()
        every = batch.eval_every
        if tokens.shape[1] == 1 and launch_plan.enabled():
            for layer in self.layers:
                layer.prepare_plan(h.dtype)
        if tokens.shape[1] == 1 and segments.SEGMENTS and not every and self.layers[0].compile_decode:
            # a few compiled calls for the whole pass (engine/models/segments.py)
            h, pending, tapped = self._segments.run(self.layers, cache[: len(self.layers)], batch, h, taps,
                                                    trace_settings())
        else:
            for i, (layer, c) in enumerate(zip(self.layers, cache[: len(self.layers)], strict=True)):
                h, pending = layer.chained(h, pending, c, batch)
                if i in taps:
                    tapped.append(with_pending(h, pending))
                if every and (i + 1) % every == 0 and i + 1 < len(self.layers):
                    mx.async_eval(h, *pending)  # the device starts on these layers while the host builds the next
        if pending:  # the last layer's output, added in the final norm's launch
            _, h = residual_norm(h, pending[0], self.norm, fused=True)
        else:
            h = self.norm(h)
        if features is not None:
            rows = mx.concatenate([*tapped, h] if features.taps.final else tapped, axis=-1).squeeze(0)
            features.record(rows, batch.deferred)
        return h


# Norms stored zero-centred in HF checkpoints (applied as 1 + w): sanitize adds 1.
ZERO_CENTRED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight",
                      "model.norm.weight", "q_norm.weight", "k_norm.weight")


class Model(nn.Module):
    """Causal LM: tokens [1, T] -> logits [1, T, V]."""

    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, args: ModelArgs, core: GDNCore | None = None) -> None:
        super().__init__()
        self.args = args
        self.core = core or select_gdn_core()
        self.model = TextModel(args, self.layer_class, self.core)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    def fuse_projections(self) -> int:
        """Fuse each layer's same-input projections (engine/models/fused.py) -> how many fused."""
        count = 0
        for layer in self.model.layers:
            mixer = layer.self_attn if layer.is_attention else layer.linear_attn
            count += int(mixer.fuse_projections()) + int(layer.mlp.fuse_projections())
        return count

    def make_cache(self) -> list[LayerCache]:
        shape = gdn_shape(self.args)
        return [KVCache() if attn else GDNCache(self.core, shape) for attn in self.args.layer_is_attention]

    def hidden(self, tokens: mx.array, cache: list[LayerCache], batch: Batch = CHAIN) -> mx.array:
        return self.model(tokens, cache, batch)

    def logits(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(self, tokens: mx.array, cache: list[LayerCache], batch: Batch = CHAIN) -> mx.array:
        return self.logits(self.hidden(tokens, cache, batch))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF layout stores the conv weight [C, 1, K] and zero-centred norms; MLX layout (mlx-lm)
        stores the conv weight [C, K, 1] with the norms already shifted."""
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        hf_layout = any(k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[-1] != 1 for k, v in weights.items())
        for name, v in weights.items():
            if name.endswith("conv1d.weight") and v.ndim == 3:
                weights[name] = v[:, 0, :] if v.shape[-1] != 1 else v[..., 0]
            elif hf_layout and v.ndim == 1 and name.endswith(ZERO_CENTRED_NORMS):
                weights[name] = v.astype(mx.float32) + 1.0
        return weights
