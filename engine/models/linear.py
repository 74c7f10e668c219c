"""The engine's float linear layer: MLX's `nn.Linear` with its weight's transpose held once.

`nn.Linear` multiplies by `weight.T`, a transposed view built anew in every graph. A view launches
nothing, but on the CPU every graph node costs its evaluation a few microseconds: 20 one-row
products of 384 x 384 weights took 0.24 ms with the view in the graph and 0.17 ms with one made
once (a compiled function, medians of 200, dev CPU), and a decode step of the bundled target
multiplies 63 weights. `hold_views(model)`, run once the weights are final (engine/loader.py),
gives every `Linear` of a model an evaluated transposed view of its weight (the weight's buffer,
no copy), which `__call__` multiplies by while the weight is still the array it was made from: a
weight replaced afterwards (loaded, quantized into another module, fused) is multiplied through
`weight.T` again, as by `nn.Linear` (the held view keeps the old buffer alive until `hold_views`
runs again). The product is the same call on the same strides either way, so the same bits
(tests/engine/test_linear.py). Writing into a weight in place would leave the held view on the old
values: nothing in the engine does. Other modules hold views of their weights the same way (the
GDN conv's columns, engine/models/gated_deltanet.py `DepthwiseConv`), and `hold_views` makes them all.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class _Held:
    """A weight and its evaluated transposed view (a plain object: nn.Module keeps arrays, dicts,
    lists and tuples as parameters, other attributes as attributes)."""

    __slots__ = ("transposed", "weight")

    def __init__(self, weight: mx.array) -> None:
        self.weight = weight
        self.transposed = weight.T
        mx.eval(self.transposed)


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        held = getattr(self, "_held", None)
        transposed = held.transposed if held is not None and held.weight is weight else weight.T
        if "bias" in self:
            return mx.addmm(self["bias"], x, transposed)
        return x @ transposed

    def hold_views(self) -> None:
        """Make (again) the transposed view __call__ multiplies by: outside any traced function."""
        self._held = _Held(self["weight"])


def hold_views(model: nn.Module) -> int:
    """Every module of `model` that holds views of its weights (a `hold_views` method) makes them
    (again) -> how many modules."""
    holders = [m for m in model.modules() if callable(getattr(m, "hold_views", None))]
    for m in holders:
        m.hold_views()
    return len(holders)
