"""A drafter's reduced output vocabulary (FR-Spec's idea): the one-pass drafters (MTP, DFlash)
score only the most frequent tokens of the target's vocabulary, through those rows of the target's
lm_head, so a depth of drafting reads a fraction of it.

Why: an MTP depth is a head pass plus an lm_head pass, and the lm_head pass is a read of the whole
output projection (the bundled target's 8192 x 384 fp32 rows: 1.9 ms a depth on the dev CPU with
the weights out of cache, 0.54 ms for the first 1024 rows; the 9B Qwen3.5 shape's 248,320 x 4096
rows in 4 bits on the H200: 0.49 ms, 0.26 ms for 32,768; scripts/bench_draft_vocab.py). A drafter
restricted this way can only propose tokens of the subset; the target's accept walk is unchanged,
so the output is too (lossless). What it costs
is acceptance where the target's next token is outside the subset (the bundled corpus: the first
1024 ranked ids cover 82 % of the tokens, 4096 cover 95 %: scripts/draft_vocab.py).

The ranking lives beside the checkpoint (`draft_vocab.safetensors`: `ranked_ids`, every id, most
frequent first; metadata `default_size`). Log-probabilities are normalised over the subset, so
the trees' path scores are those of the drafter's distribution renormalised to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engine import half_weights
from engine.models.base import CausalLM
from engine.models.qlinear import RowsQuantizedEmbedding, RowsQuantizedLinear
from engine.qmm import quantized_linear
from engine.rotation import RotatedLinear, RotatedQuantizedLinear

FILE = "draft_vocab.safetensors"
Logits = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class DraftVocab:
    ids: mx.array  # int32 [N]: the token ids a drafter may propose, most frequent first
    # the target's lm_head over these ids (`bound`), gathered once per engine rather than per
    # request's drafter; None: a drafter gathers its own (sub_logits)
    logits: Logits | None = None

    def bound(self, target: CausalLM) -> DraftVocab:
        return replace(self, logits=sub_logits(target, self))

    def logits_for(self, target: CausalLM) -> Logits:
        return self.logits if self.logits is not None else sub_logits(target, self)

    @classmethod
    def load(cls, checkpoint: str | Path, size: int | None = None) -> DraftVocab | None:
        """The first `size` ranked ids of the checkpoint's ranking (None: its default size; 0: no
        reduced vocabulary -> None). No ranking file: None for size None, an error for size > 0."""
        if size == 0:
            return None
        path = Path(checkpoint) / FILE
        if not path.is_file():
            if size is None:
                return None
            raise FileNotFoundError(f"a draft vocabulary of {size} tokens needs {FILE} in {checkpoint} "
                                    "(scripts/draft_vocab.py writes it)")
        tensors, metadata = mx.load(str(path), return_metadata=True)  # type: ignore[misc]
        ranked_ids: mx.array = tensors["ranked_ids"]  # type: ignore[index,assignment]
        n = int(metadata.get("default_size", ranked_ids.shape[0])) if size is None else size  # type: ignore[union-attr]
        if not 0 < n <= ranked_ids.shape[0]:
            raise ValueError(f"draft vocabulary size must be in 1..{ranked_ids.shape[0]}, got {n}")
        if n == ranked_ids.shape[0]:
            return None  # the whole vocabulary: the full lm_head is the cheaper way to it
        return cls(ranked_ids[:n].astype(mx.int32))

    def full_ids(self, sub: mx.array) -> mx.array:
        """Indices into the subset -> the target's token ids (same shape)."""
        return self.ids[sub]


def output_projection(target: CausalLM) -> nn.Module:
    """The module whose rows are the target's lm_head: the tied embedding or `lm_head`."""
    if target.args.tie_word_embeddings:
        return target.model.embed_tokens  # type: ignore[attr-defined,no-any-return]
    return target.lm_head  # type: ignore[attr-defined,no-any-return]


def sub_logits(target: CausalLM, vocab: DraftVocab) -> Logits:
    """h [..., H] -> the target's logits of the subset's ids [..., N], through those rows of the
    output projection only (gathered once, here). Equal to `target.logits(h)[..., vocab.ids]`
    (tests/engine/test_draft_vocab.py), which is also the fallback for a projection this does not
    know (rotated inputs: no saving there)."""
    proj = output_projection(target)
    ids = vocab.ids
    if isinstance(proj, (RotatedLinear, RotatedQuantizedLinear)) or "weight" not in proj:
        return lambda h: mx.take(target.logits(h), ids, axis=-1)
    weight = proj["weight"][ids]
    bias = proj["bias"][ids] if isinstance(proj, nn.Linear) and "bias" in proj else None
    if "scales" in proj:
        scales = proj["scales"][ids]
        biases = proj["biases"][ids] if "biases" in proj else None
        mx.eval(weight, scales, *([] if biases is None else [biases]))
        group_size, bits, mode = proj.group_size, proj.bits, proj.mode  # type: ignore[attr-defined]
        routed = isinstance(proj, (RowsQuantizedLinear, RowsQuantizedEmbedding))  # the matmul the target's takes

        def quantized(h: mx.array) -> mx.array:
            y = quantized_linear(h, weight, scales, biases, group_size, bits, mode, routed=routed)
            return y if bias is None else y + bias

        return quantized
    dense = DenseRows(weight, bias)
    half_weights.register(dense, [weight])  # the gathered rows: a copy of their own
    return dense


class DenseRows:
    """h [..., H] -> h @ weight.T (+ bias): the output projection's gathered rows, as a callable
    that also says what it multiplies by (the CPU's one-operation MTP chain reads `weight`)."""

    def __init__(self, weight: mx.array, bias: mx.array | None) -> None:
        self.weight, self.bias = weight, bias
        self.transposed = weight.T  # made once: a view built in every depth's graph is a node the CPU evaluates
        mx.eval(weight, self.transposed, *([] if bias is None else [bias]))

    def __call__(self, h: mx.array) -> mx.array:
        y = h @ self.transposed
        return y if self.bias is None else y + self.bias
