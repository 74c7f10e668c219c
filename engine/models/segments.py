"""A one-token pass (a decode step, a drafter's chain step) as one compiled call per stretch of
layers between two attention layers' cache accesses.

A layer runs as pure functions around its cache access (engine/models/qwen3_5.py DecoderLayer),
compiled one layer at a time: a 9B-shaped step made ~40 compiled calls (one a GDN layer, two an
attention layer), and each call costs the host its own Python and MLX's input checks and replay
besides the operations it holds. On a GPU a decode step waits for the host. Here a segment runs the
attention output of the layer that opens it, every GDN layer after it, and the projections of the
attention layer that closes it, as one trace; only the attention layers' `attend` (RoPE, the K/V
write at the cache's offset, the attention) runs between segments, as before. The layers' own pure
functions are what a segment traces, so a segment's graph is the layers' graphs joined: the same
operations on the same inputs (tests/engine/test_segments.py holds logits and states bitwise equal
to the layer-by-layer path, on the CPU and on an H100).

Measured (`python scripts/profile_host.py --rows 1 --compile on,sg0,on,sg0,...`, medians): building
a 9B-shaped 4-bit step on an H100 host 1.13-1.29 ms against 1.30-1.35 layer by layer (three
alternations; its encoding, 2.6-2.9 ms, is unchanged), the bundled target on the dev CPU 0.19
against 0.215 ms. End to end that is within the machines' noise (BENCHMARKS.md, issue 13,
forty-fourth session): what a step's host time is made of is mostly the operations themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from engine.cache import GDNCache, KVCache, LayerCache
from engine.models.layers import Batch

# module switch: False runs a one-token pass layer by layer (tests and the benchmarks' variant -sg0
# compare the two)
SEGMENTS = True

Pending = tuple[mx.array, ...]  # a layer's output not yet added to the residual stream: () or (y,)


class TokenLayer(Protocol):  # engine.models.qwen3_5.DecoderLayer
    is_attention: bool
    self_attn: Any
    linear_attn: Any

    def token_functions(self) -> tuple[Callable[..., Any], Callable[..., Any]]: ...


@dataclass(frozen=True)
class Segment:
    """One compiled call of a one-token pass: the output phase of attention layer `opens` (whose
    attend ran just before), the GDN layers `gdn`, then the projections of attention layer
    `closes` (whose attend runs just after); either end may be absent."""

    opens: int | None
    gdn: tuple[int, ...]
    closes: int | None


def plan(is_attention: Sequence[bool]) -> tuple[Segment, ...]:
    """The segments of a model whose layers are attention (True) or GDN (False), in order."""
    segments: list[Segment] = []
    opens: int | None = None
    gdn: list[int] = []
    for i, attention in enumerate(is_attention):
        if attention:
            segments.append(Segment(opens, tuple(gdn), i))
            opens, gdn = i, []
        else:
            gdn.append(i)
    segments.append(Segment(opens, tuple(gdn), None))
    return tuple(segments)


def split(out: tuple[mx.array, ...]) -> tuple[mx.array, Pending]:
    """A layer's (h,) or (h, pending) -> (h, pending)."""
    return out[0], tuple(out[1:])


def with_pending(h: mx.array, pending: Pending) -> mx.array:
    """The residual stream with the last layer's pending output added (what a drafter taps)."""
    return h + pending[0] if pending else h


def segment_function(layers: Sequence[TokenLayer], segment: Segment, taps: frozenset[int]) -> Callable[..., Any]:
    """The pure function of `segment`: (h, pending, carry, states) -> (h, pending, results,
    projections, tapped). carry: the opening layer's attention output and gate; states: each GDN
    layer's (conv state, state); results: what each GDN layer's cache keeps; projections: the
    closing layer's [q, k, v, (gate)]; tapped: the stream after each layer in `taps`, in order."""

    def run(h: mx.array, pending: Pending, carry: tuple[mx.array, ...],
            states: list[tuple[mx.array, mx.array]]) -> tuple[Any, ...]:
        tapped: list[mx.array] = []
        if segment.opens is not None:
            _, output = layers[segment.opens].token_functions()
            h, pending = split(output(h, *carry))
            if segment.opens in taps:
                tapped.append(with_pending(h, pending))
        results = []
        for i, (conv_state, S) in zip(segment.gdn, states, strict=True):
            layer, finish = layers[i].token_functions()
            out, result = layer(h, pending, conv_state, S, (), 0)
            h, pending = split(finish(out))
            results.append(result)
            if i in taps:
                tapped.append(with_pending(h, pending))
        projections: list[mx.array] = []
        if segment.closes is not None:
            project, _ = layers[segment.closes].token_functions()
            h, *projections = project(h, pending)
            pending = ()
        return h, pending, results, projections, tapped

    return run


class Segments:
    """A model's segment functions, compiled once per (segment, input form, taps, the layers'
    trace settings)."""

    def __init__(self, is_attention: Sequence[bool]) -> None:
        self.plan = plan(is_attention)
        self.compiled: dict[tuple[object, ...], Callable[..., Any]] = {}

    def run(self, layers: Sequence[TokenLayer], cache: Sequence[LayerCache], batch: Batch, h: mx.array,
            taps: Sequence[int], settings: tuple[object, ...]) -> tuple[mx.array, Pending, list[mx.array]]:
        """The one-token pass over every layer from the embedded row h -> (h, pending, tapped)."""
        pending: Pending = ()
        carry: tuple[mx.array, ...] = ()
        tapped: list[mx.array] = []
        wanted = frozenset(taps)
        for segment in self.plan:
            key = (segment, bool(pending), len(carry), wanted, settings)
            function = self.compiled.get(key)
            if function is None:
                function = self.compiled[key] = mx.compile(segment_function(layers, segment, wanted))
            states = []
            for i in segment.gdn:
                c = cache[i]
                assert isinstance(c, GDNCache)
                states.append(c.states(h.dtype))
            h, pending, results, projections, more = function(h, pending, carry, states)
            pending, tapped = tuple(pending), tapped + list(more)
            for i, result in zip(segment.gdn, results, strict=True):
                c = cache[i]
                assert isinstance(c, GDNCache)
                layers[i].linear_attn.store(c, batch, "token", tuple(result), 1)
            if segment.closes is not None:
                c = cache[segment.closes]
                assert isinstance(c, KVCache)
                q, k, v, *gate = projections
                carry = (layers[segment.closes].self_attn.attend(q, k, v, c, batch), *gate)
        return h, pending, tapped
