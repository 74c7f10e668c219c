"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3.6 checkpoints (`mtp.*` tensors).

For the token x_{i+1} and the target's final-normed hidden state h_i of position i:

    x = fc([pre_fc_norm_embedding(embed(x_{i+1})); pre_fc_norm_hidden(h_i)])
    x = one full-attention decoder layer (the target's attention layer shape, own KV cache), at position i
    y = norm(x)  ->  the target's lm_head gives the distribution of x_{i+2}

and y stands in for h_{i+1} when drafting further (vLLM's and SGLang's recursion). The embedding
and lm_head are the target's. HF stores every MTP norm zero-centred (applied as 1 + w), like the
target's own; `sanitize` adds the 1.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.cache import KVCache
from engine.gdn.core import OpsCore
from engine.models.base import ModelArgs
from engine.models.layers import CHAIN, Batch, RMSNorm
from engine.models.qwen3_5 import DecoderLayer

# every RMSNorm of the head: its own three and the decoder layer's four
ZERO_CENTRED = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


class MTPHead(nn.Module):
    def __init__(self, args: ModelArgs, layers: int = 1) -> None:
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, eps)
        self.pre_fc_norm_hidden = RMSNorm(H, eps)
        # attention layers never call their GDN core: any core will do
        self.layers = [DecoderLayer(args, True, OpsCore()) for _ in range(layers)]
        self.norm = RMSNorm(H, eps)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: list[KVCache],
                 batch: Batch = CHAIN) -> mx.array:
        """embedded, hidden [1, T, H] of consecutive positions from cache.offset -> y [1, T, H]."""
        x = mx.concatenate([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        for layer, c in zip(self.layers, cache, strict=True):
            x = layer(x, c, batch)
        return self.norm(x)

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names without the `mtp.` prefix; every RMSNorm weight gets the +1 of HF's zero-centred norms."""
        return {k: (v.astype(mx.float32) + 1.0 if k.endswith(ZERO_CENTRED) and v.ndim == 1 else v)
                for k, v in weights.items()}
