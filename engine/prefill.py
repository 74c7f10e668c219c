"""Prefill through a prefix cache, taking snapshots (llama.cpp's "context checkpoints") on the way.

A hybrid model's recurrent state cannot be cut back, so a later prompt can resume only where a
snapshot was taken. Besides the end of the prompt, snapshots are taken where the next request is
likely to diverge:
- before each chat turn (`<|im_start|>`): the next turn of a conversation re-renders the history;
- after each fill-in-the-middle marker (`<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`,
  `<|file_sep|>`): an editor's next keystroke changes the text after `<|fim_middle|>` (llama.vim
  sends the cursor line there) or the end of the prefix, and its warm-up request (n_predict 0)
  shares everything up to `<|fim_prefix|>` with the real one;
- every `every` tokens, for long prompts edited near their end.
Only the last `keep` cuts of each kind are taken in one prompt: a snapshot holds a copy of the
attention K/V up to its cut, so many of them on one long prompt would cost memory quadratically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine import forward
from engine.cache import LayerCache
from engine.kernels import gpu_backend
from engine.models.base import CausalLM
from engine.prefix_cache import PrefixCache

FIM_MARKERS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>")
TURN_MARKERS = ("<|im_start|>",)


# Tokens a prefill forward pass takes. On a GPU a long chunk pays: a pass dequantizes each weight
# once for all its rows (engine/qmm.py, CUDA_DEQUANT_ROWS), and mlx-lm prefills 2048 at a time
# too (H200, 9B shape 4-bit, 4k prompt: 13,359 tok/s at 2048 against 8,295 at 512). On the CPU the
# attention over a longer chunk costs more than it saves (4-bit bundled target, 4k prompt: 623
# tok/s at 2048 against 706 at 512). scripts/bench_prefill.py; BENCHMARKS.md, "prefill".
GPU_PREFILL_CHUNK = 2048
CPU_PREFILL_CHUNK = 512


def default_prefill_chunk() -> int:
    return CPU_PREFILL_CHUNK if gpu_backend() is None else GPU_PREFILL_CHUNK


@dataclass(frozen=True)
class CheckpointRule:
    before: frozenset[int] = frozenset()  # snapshot before these tokens
    after: frozenset[int] = frozenset()  # snapshot after these tokens
    every: int = 0  # and every this many tokens (0: never)
    keep: int = 2  # per kind (before, after, every), the last `keep` cuts of a prompt

    @classmethod
    def of(cls, tokenizer, every: int) -> CheckpointRule:
        def ids(texts: Sequence[str]) -> frozenset[int]:
            return frozenset(t for t in (tokenizer.token_id(x) for x in texts) if t is not None)

        return cls(ids(TURN_MARKERS), ids(FIM_MARKERS), every, keep=3)


def checkpoint_cuts(ids: Sequence[int], start: int, rule: CheckpointRule) -> list[int]:
    """Positions p in (start, len(ids)) at which to snapshot ids[:p], ascending."""
    n = len(ids)
    before = [p for p in range(start + 1, n) if ids[p] in rule.before]
    after = [p + 1 for p in range(start, n - 1) if ids[p] in rule.after]
    every = list(range((start // rule.every + 1) * rule.every, n, rule.every)) if rule.every > 0 else []
    cuts = {p for kind in (before, after, every) for p in kind[-rule.keep:]}
    return sorted(p for p in cuts if start < p < n)


def prefill(model: CausalLM, cache: list[LayerCache], ids: Sequence[int], chunk: int, prefix: PrefixCache,
            rule: CheckpointRule) -> int:
    """Fill fresh caches with `ids`: resume from the prefix cache, prefill the rest in chunks,
    snapshot at the rule's cuts and at the end. -> tokens restored from the prefix cache."""
    cached = prefix.restore_longest(ids, cache)
    start = cached
    for stop in [*checkpoint_cuts(ids, cached, rule), len(ids)]:
        forward.extend(model, cache, ids[start:stop], chunk)
        prefix.store(cache, ids[:stop], "prompt" if stop == len(ids) else "boundary")
        start = stop
    return cached


@dataclass
class Prefiller:
    """One model's prefix cache and checkpoint rule: fill(model, cache, ids) -> tokens restored."""

    prefix: PrefixCache
    rule: CheckpointRule
    chunk: int

    def fill(self, model: CausalLM, cache: list[LayerCache], ids: Sequence[int]) -> int:
        return prefill(model, cache, ids, self.chunk, self.prefix, self.rule)
