"""DFlash drafter ("dflash"): one draft pass proposes marginals for the whole next block, a tree
builder (engine/drafters/marginals.py) turns them into the draft tree.

The drafter reads the target's hidden states of committed positions from the target's
FeatureCache (engine/feature_cache.py): before each proposal, the rows committed since the last
one are projected into the context K/V of every draft layer, so the context grows with the
accepted rows only and nothing is rolled back. The block `[root, MASK x (block_size - 1)]` sits
at positions committed_len ..; its K/V are scratch rows of the same caches.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.drafters.draft_vocab import DraftVocab
from engine.drafters.marginals import Marginals
from engine.drafters.marginals import chain as chain_builder
from engine.drafters.weaver import WeaverTrees
from engine.feature_cache import FeatureCache, FeatureTaps
from engine.models.base import CausalLM
from engine.models.dflash import DFlashModel
from engine.tree import DraftTree

TreeBuilder = Callable[[int, Marginals, int, int], DraftTree]


class DFlashDrafter:
    def __init__(self, target: CausalLM, model: DFlashModel, build: TreeBuilder, top_k: int = 32,
                 weaver: WeaverTrees | None = None, vocab: DraftVocab | None = None,
                 top1_chains: bool = False) -> None:
        if model.config.hidden_size != target.args.hidden_size:
            raise ValueError(f"DFlash hidden size {model.config.hidden_size} differs from the target's "
                             f"{target.args.hidden_size}")
        if max(model.config.target_layer_ids) >= target.args.num_hidden_layers:
            raise ValueError(f"DFlash reads target layers {model.config.target_layer_ids}; the target has "
                             f"{target.args.num_hidden_layers}")
        self.target, self.model, self.build, self.top_k, self.weaver = target, model, build, top_k, weaver
        self.top1_chains = top1_chains and weaver is None  # `build` drafts the chain of top-1s (ChainsOnDevice)
        # the block's lm_head rows: the draft vocabulary's where there is one (logits' columns are then its ids)
        self.vocab = vocab
        self.logits = target.logits if vocab is None else vocab.logits_for(target)
        self.host_ids = None if vocab is None else np.array(vocab.ids).astype(np.int64)  # columns -> ids, on the host
        # Weaver's prompt starts with the target's final-normed hidden state of the last committed position
        self.taps = FeatureTaps(tuple(set(model.config.target_layer_ids)), final=weaver is not None)
        self.features: FeatureCache | None = None
        self.slots: mx.array | None = None
        self.cache = model.make_cache()
        self.embed: Callable[[mx.array], mx.array] = target.model.embed_tokens  # type: ignore[attr-defined]

    def attach(self, features: FeatureCache) -> None:
        """The target's feature cache of this generation (its taps include this drafter's)."""
        self.features = features
        self.slots = mx.array(features.taps.slots(self.model.config.target_layer_ids, final=False))

    def begin(self, prompt_ids: list[int]) -> None:
        self.cache = self.model.make_cache()
        if self.features is not None and self.features.length:
            self._catch_up()  # the prompt's context rows: part of the prompt's time
            mx.eval([a for c in self.cache for a in c.arrays()])

    def _catch_up(self) -> int:
        """Project the committed feature rows not yet in the context -> the committed length."""
        assert self.features is not None and self.slots is not None, "attach() the target's features first"
        seen, committed = self.cache[0].offset, self.features.length
        if committed > seen:
            rows = self.features.read(seen, committed)
            rows = rows.reshape(rows.shape[0], -1, self.target.args.hidden_size)[:, self.slots]
            self.model.append_context(rows.reshape(rows.shape[0], -1), self.cache)
        return committed

    def draft(self, root: int | mx.array, depth: int) -> tuple[mx.array, mx.array]:
        """The block after `root` (an id, or one still on the device [1, 1]): final hidden states
        [depth, H] and logits [depth, V] (lazy); V columns are the draft vocabulary's ids where the
        drafter has one."""
        c = self.model.config
        masks = [c.mask_token_id] * (c.block_size - 1)
        if isinstance(root, mx.array):
            block = mx.concatenate([root.reshape(1, 1).astype(mx.int32), mx.array([masks], dtype=mx.int32)], axis=1)
        else:
            block = mx.array([[root] + masks])
        embedded = self.embed(block)
        if c.input_embedding_scale != 1.0:
            embedded = embedded * c.input_embedding_scale
        h = self.model.block(embedded, self.cache)[0, 1 : 1 + depth]
        return h, self.model.scale_logits(self.logits(h))

    def marginals(self, root: int, depth: int) -> Marginals:
        """Top-k marginals of the next `depth` positions after `root`."""
        m = Marginals.from_logits(self.draft(root, depth)[1], self.top_k)
        return m if self.host_ids is None else Marginals(self.host_ids[m.ids], m.logp)

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        committed = self._catch_up()  # even for a root-only tree: the context stays in step
        depth = min(max_depth, budget, self.model.config.block_size - 1)
        if depth < 1:
            mx.eval([a for c in self.cache for a in c.arrays()])
            return DraftTree.single(root)
        if self.weaver is not None and committed > 0:
            assert self.features is not None
            H = self.target.args.hidden_size
            final = self.features.taps.slots((), final=True)[0]
            h_target = self.features.read(committed - 1, committed)[0, final * H : (final + 1) * H]
            hidden, logits = self.draft(root, depth)
            return self.weaver.build(root, h_target, hidden, logits, budget, max_depth,
                                     None if self.vocab is None else self.vocab.ids)
        return self.build(root, self.marginals(root, depth), budget, max_depth)

    def chain_depth(self, max_depth: int) -> int | None:
        return min(max_depth, self.model.config.block_size - 1) \
            if self.build is chain_builder and self.weaver is None else None

    def chain_on_device(self, root: int, budget: int, max_depth: int) -> mx.array | None:
        """The chain builder's tree without a host round trip (ChainsOnDevice): the block's
        argmax at each depth, lazy."""
        if not self.top1_chains:
            return None
        self._catch_up()
        depth = min(max_depth, budget, self.model.config.block_size - 1)
        if depth < 1:
            return None
        ids = mx.argmax(self.draft(root, depth)[1], axis=-1)
        return ids if self.vocab is None else self.vocab.full_ids(ids)

    def guess_after(self, root: mx.array) -> mx.array | None:
        """The block's top-1 at depth 1 after `root`, a token still on the device whose position
        is committed (its round is queued, not landed), lazily: the one-guess tree of chain and
        DDTree. None with Weaver, whose one-node tree is its own choice, not the top-1."""
        if self.weaver is not None or self.features is None:
            return None
        self._catch_up()
        token = mx.argmax(self.draft(root, 1)[1][0])
        return (token if self.vocab is None else self.vocab.full_ids(token)).reshape(1, 1)

    def observe(self, emitted: list[int]) -> None:
        """Nothing to do: the accepted rows reach the context through the feature cache."""

    def skip(self, root: int, emitted: list[int]) -> None:
        """A round without a tree: nothing either; the next propose projects every row committed
        since, in one pass."""
