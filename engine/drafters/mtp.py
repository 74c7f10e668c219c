"""MTP drafter ("mtp"): the target's own multi-token-prediction head drafts a chain recursively,
and a tree builder (engine/drafters/marginals.py) adds siblings from each step's top-k.

The head's KV cache holds one row per committed position i, made from (x_{i+1}, h_i), where h_i
is the target's final-normed hidden state (read from the target's FeatureCache). Before each
proposal the rows of the positions committed since the last one are appended in one chain pass,
whose last row (the root's token with the last committed hidden state) already gives the
marginal of depth 1; deeper steps feed the head its own output and the top-1 token, in rows past
the committed ones that the draft drops again (engine/drafters/mtp_steps.py: compiled, or the
plain twin through the head's cache). On the CPU the catch-up and every depth of a draft run as
one operation of the engine's own where it is built for the head (CpuChain), the loop over the
steps being its twin.

Each depth costs a head pass and a target lm_head pass, most of the drafting time, so the draft
stops early where deeper depths could not matter: once the top-1 path's probability under the
head's marginals falls below `min_path_prob`, every deeper node's is below it too (a node's score
is a sum of per-depth log-marginals, each at most its depth's top-1). The tree may then be
shallower; what is emitted never changes (the accept walk is the target's alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine import cpu_ext
from engine.config import METHOD_DEPTHS, SamplingParams
from engine.device_sampler import node_uniforms
from engine.drafters.draft_vocab import DraftVocab
from engine.drafters.marginals import Marginals
from engine.drafters.marginals import chain as chain_builder
from engine.drafters.mtp_steps import CompiledSteps, CpuChain, Depths, PlainDepths
from engine.feature_cache import FeatureCache, FeatureTaps
from engine.kernels import gpu_backend
from engine.models.base import CausalLM
from engine.models.mtp import MTPHead
from engine.tree import DraftTree

TreeBuilder = Callable[[int, Marginals, int, int], DraftTree]


@dataclass(frozen=True)
class MTPConfig:
    # Each step beyond the first costs one head pass and conditions on drafted, not target, states.
    # make_drafter sets it to the spec's depth (by default METHOD_DEPTHS["mtp"]).
    max_steps: int = METHOD_DEPTHS["mtp"]
    top_k: int = 32
    # Stop drafting deeper once the top-1 path's probability is below this (0: always max_steps);
    # None: MIN_PATH_PROB.
    min_path_prob: float | None = None
    compiled: bool = True  # the compiled per-depth steps; False: the plain twin (tests hold them equal)
    # Where the stop rule is applied. True: every depth is read on the host before the next is
    # drafted, so the depths past the stop are never computed (the CPU, where a depth is ~1 ms of
    # compute and a sync costs little). False: all depths are queued as one graph and evaluated
    # once, the rule cutting the marginals afterwards (GPUs, where a depth's compute is a few
    # launches and each host round trip costs more: the bundled pair on the H200 spent 40-50 % of a
    # round drafting, depth by depth). The same marginals either way (tests/engine/test_mtp_steps.py).
    # None: True on the CPU, False on a GPU.
    sync_each_depth: bool | None = None


# MTPConfig.min_path_prob's default (a module switch, so that benchmarks can compare bounds within
# one engine: scripts/variants.py's "-mpN" is N / 100).
# A depth is worth its cost while it adds more expected accepted tokens than it costs in time:
# on the bundled model on a 2-core CPU a depth (head + lm_head pass) is ~8 % of a round that
# emits ~2.4 tokens, about 0.2 tokens' worth. With 0.3 (and the compiled steps) the drafting
# share fell from 41 % to 30 % (ddtree) and 47 % to 35 % (chain), tokens per forward moving by
# at most 0.12 on any prompt (BENCHMARKS.md, "One-pass drafters"); where head steps are cheap
# next to a verify (a large target on a GPU), a lower bound keeps more depth. The head trained on
# the target's distribution at six depths (2026-12-07) is less sure of itself, so the bound cuts its
# chains sooner; without it (0) its chains accepted more but were not faster on the dev CPU, nor was
# 0.15 on every prompt (BENCHMARKS.md, issue 12, fifty-fifth session).
MIN_PATH_PROB = 0.3

# The most committed rows the CPU's one-operation draft catches up on itself: its rows go one by
# one, where MLX's catch-up multiplies them together (a round commits a few; a run of rounds
# without a tree leaves more, up to a skip's whole run).
CATCH_UP_IN_ONE = 16

# The most committed rows the head is left behind by rounds without its tree (skip): from this many
# on, skip queues their catch-up behind the round in flight. Left to the next propose, a run of
# plain rounds is caught up in one pass right before a tree's verify, a stall that grows with the
# run (dev CPU: 113 rows, 3.4 ms, against a ~1.2 ms plain round; a 1,000-token request had 193 rows
# owed at once). In pieces the same rows cost a bump every this many tokens, and decoding was as
# fast (512 tokens: 1.004x without it, paired). 0: the whole run at the next propose (variant
# "-skN" sets it).
SKIP_CATCH_UP = 32

# Where the target samples, the CPU's one-operation chain guesses each depth's token by a draw at
# the uniform the target's own draw at that position will use, under the request's settings, where
# it took the argmax (MTPDrafter.sample_like; scripts/variants.py's "-cu0" turns it off). The accept
# rule is unchanged, so the output is too; only how often the guesses are accepted moves.
COUPLED_DRAWS = True
COUPLED_TOP_K = 64  # the largest top-k a coupled draw is made under (the head's rows it ranks)

# MTPConfig.sync_each_depth's None on a GPU (a module switch, so that benchmarks can compare the two
# within one engine: scripts/bench_gpu.py's variant suffix "-sd1")
SYNC_EACH_DEPTH_ON_GPU = False


class MTPDrafter:
    def __init__(self, target: CausalLM, head: MTPHead, build: TreeBuilder, config: MTPConfig = MTPConfig(),
                 vocab: DraftVocab | None = None, top1_chains: bool = False) -> None:
        self.target, self.head, self.build, self.config = target, head, build, config
        self.top1_chains = top1_chains  # `build` drafts the chain of top-1s (ChainsOnDevice applies)
        # the lm_head pass of every depth: over the draft vocabulary's rows where there is one
        self.vocab_ids = None if vocab is None else vocab.ids
        self.logits = target.logits if vocab is None else vocab.logits_for(target)
        self.taps = FeatureTaps(final=True)
        self.features: FeatureCache | None = None
        self.slot = 0
        self.tokens: list[int] = []  # prompt + emitted; tokens[committed] is the root
        self.cache = head.make_cache()
        self.embed: Callable[[mx.array], mx.array] = target.model.embed_tokens  # type: ignore[attr-defined]
        self.steps = CompiledSteps(self.logits, self.embed, head, config.max_steps - 1, self.vocab_ids) \
            if config.compiled else None
        bound = MIN_PATH_PROB if config.min_path_prob is None else config.min_path_prob
        self.log_min_path = math.log(bound) if bound > 0 else -math.inf
        # every depth of a draft in one operation, where the CPU's is built for this head (compiled
        # steps only: the plain twin stays plain)
        self.cpu_chain = CpuChain.build(target, head, self.logits, self.vocab_ids) if config.compiled else None
        self.last: mx.array | None = None  # the head's output at the last row it has caught up to
        self.draws: tuple[SamplingParams, int, int] | None = None  # sample_like's (params, seed, position)
        self.sync_each_depth = (gpu_backend() is None or SYNC_EACH_DEPTH_ON_GPU) if config.sync_each_depth is None \
            else config.sync_each_depth

    def attach(self, features: FeatureCache) -> None:
        self.features = features
        self.slot = features.taps.slots((), final=True)[0]

    def begin(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids)
        self.cache = self.head.make_cache()
        self.last = None
        if self.features is not None and self.features.length:
            # the head's rows of the prompt: its prefill, part of the prompt's time like a draft
            # model's (left to the first propose, it was a stall in the first decode round)
            last = self._catch_up()
            mx.eval([a for c in self.cache for a in c.arrays()], *([] if last is None else [last]))

    def _hidden(self, start: int, stop: int) -> mx.array:
        """The target's final-normed hidden states of positions [start, stop), [1, T, H]."""
        assert self.features is not None, "attach() the target's features first"
        rows = self.features.read(start, stop)
        H = self.target.args.hidden_size
        return rows[:, self.slot * H : (self.slot + 1) * H][None]

    def _catch_up(self, stop: int | None = None) -> mx.array | None:
        """Append the head's rows of newly committed positions (up to `stop`, default all) -> the
        output [1, 1, H] of the last row appended (None before the first row)."""
        assert self.features is not None
        done, committed = self.cache[0].offset, self.features.length if stop is None else stop
        if committed > done:
            ids = mx.array([self.tokens[done + 1 : committed + 1]])
            self.last = self.head.append(self.embed(ids), self._hidden(done, committed), self.cache)
        return self.last

    def sample_like(self, params: SamplingParams | None, seed: int = 0, position: int = 0) -> None:
        """Guess the next draft's chain tokens as the target's seeded draws would take them from the
        head's distribution (COUPLED_DRAWS; the CPU's one-operation chain only): depth d at the
        uniform of position `position` + d - 1, the index the target's draw at the parent node's row
        gives its token. None, or greedy params: the argmax, as always."""
        self.draws = None if params is None or params.greedy else (params, seed, position)

    def _chain_draws(self, depth: int) -> cpu_ext.ChainDraws | None:
        """The draws of a `depth`-deep chain, where sample_like set them and the request has a top-k
        the head can draw under. Without a top-k the target's running sum in vocabulary order takes
        every token's mass, which the head's few likely rows cannot follow: its draw and the
        target's then part at almost every uniform (chat at temperature 1: 1.05 tokens per forward
        against 1.07 with the argmax), so the argmax stays."""
        if not COUPLED_DRAWS or self.draws is None or not 0 < self.draws[0].top_k <= COUPLED_TOP_K:
            return None
        params, seed, position = self.draws
        return cpu_ext.ChainDraws(node_uniforms(seed, range(position, position + depth)), params.temperature,
                                  params.top_k, params.top_p)

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        depth = min(max_depth, budget, self.config.max_steps)
        k = max(1, min(budget, self.config.top_k))
        marginals = self._caught_up_draft(depth, k) if depth >= 1 else None
        if marginals is not None:
            return self.build(root, marginals, budget, max_depth)
        last = self._catch_up()
        if last is None or depth < 1:
            mx.eval([a for c in self.cache for a in c.arrays()])
            return DraftTree.single(root)
        marginals = self._draft(last, depth, k)
        return self.build(root, marginals, budget, max_depth)

    def _caught_up_draft(self, depth: int, k: int) -> Marginals | None:
        """The catch-up and the draft in one CPU operation (CpuChain.draft_after), where it serves
        and there are at most CATCH_UP_IN_ONE rows to catch up on; else None (the catch-up in MLX's
        operations, then _draft)."""
        if self.features is None:
            return None
        done, committed = self.cache[0].offset, self.features.length
        chain = self._catching_up_in_one(done, committed) if committed > done else None
        if chain is None:
            return None
        tokens = mx.array(self.tokens[done + 1 : committed + 1], dtype=mx.int32)
        ids, logp, self.last = chain.draft_after(tokens, self._hidden(done, committed)[0], self.cache[0], depth, k,
                                                 self.log_min_path, self._chain_draws(depth))
        return Marginals(ids.astype(np.int64), logp.astype(np.float64))

    def _catching_up_in_one(self, done: int, committed: int) -> CpuChain | None:
        """The CPU's one operation (CpuChain) where it takes the catch-up of positions [done,
        committed): it serves this head, the prompt's rows are in, and there are few enough."""
        if cpu_ext.MTP_CHAIN and 0 < done and committed - done <= CATCH_UP_IN_ONE:
            return self.cpu_chain
        return None

    def chain_depth(self, max_depth: int) -> int | None:
        return min(max_depth, self.config.max_steps) if self.build is chain_builder else None

    def chain_on_device(self, root: int, budget: int, max_depth: int) -> mx.array | None:
        """The chain builder's tree without a host round trip (ChainsOnDevice): the top-1 of each
        depth fed back as the next depth's input, all lazy, at full depth (no stop rule)."""
        if not self.top1_chains:
            return None
        last = self._catch_up()
        depth = min(max_depth, budget, self.config.max_steps)
        if last is None or depth < 1:
            return None
        # the catch-up's rows go to the device now, ahead of the draft that reads them
        mx.async_eval([a for c in self.cache for a in c.arrays()])
        depths = self._depths(1)
        y, tokens = last, [depths.top1(last)]
        while len(tokens) < depth:
            y = depths.advance(tokens[-1], y)
            tokens.append(depths.top1(y))
        depths.close()
        return mx.concatenate(tokens, axis=1)[0]

    def guess_after(self, root: mx.array) -> mx.array | None:
        """The head's top-1 after `root`, a token still on the device whose position is committed
        (its round is queued, not landed): the catch-up's last row is (root, the last committed
        hidden state), so the guess is that row's argmax, all of it lazy. The same token propose
        puts in a one-guess tree (chain and DDTree both take the top-1 of depth 1); where the request
        samples, the CPU's operation draws it at the root row's uniform instead (sample_like)."""
        assert self.features is not None
        done, committed = self.cache[0].offset, self.features.length
        if committed <= done or len(self.tokens) != committed:  # nothing to catch up on / not one behind
            return None
        known = mx.array([self.tokens[done + 1 : committed]], dtype=mx.int32)
        ids = mx.concatenate([known, root.reshape(1, 1).astype(mx.int32)], axis=1)
        chain = self._catching_up_in_one(done, committed)
        if chain is not None:
            # the catch-up and its row's argmax in one CPU operation, lazy like the rest
            guess, self.last = chain.guess_after(ids[0], self._hidden(done, committed)[0], self.cache[0],
                                                 self._chain_draws(1))
            return guess
        self.last = self.head.append(self.embed(ids), self._hidden(done, committed), self.cache)
        token = mx.argmax(self.logits(self.last)[0, 0])
        return (token if self.vocab_ids is None else self.vocab_ids[token]).reshape(1, 1)

    def _depths(self, k: int) -> Depths:
        """A draft's per-depth steps from the head's cache (top-k width k): compiled, or the plain twin."""
        if self.steps is not None:
            return self.steps.begin(self.cache, k)
        return PlainDepths(self.logits, self.embed, self.head, self.cache, k, self.vocab_ids)

    def _draft(self, y: mx.array, depth: int, k: int) -> Marginals:
        """The top-k marginals of depths 1..depth (fewer where the top-1 path's probability drops
        below min_path_prob), from the head's output y [1, 1, H] of the last committed row."""
        committed = [a for c in self.cache for a in c.arrays()]
        if self.cpu_chain is not None and cpu_ext.MTP_CHAIN:  # read per draft: benchmarks switch it
            ids, logp = self.cpu_chain.draft(y, self.cache[0], depth, k, self.log_min_path, committed,
                                             self._chain_draws(depth))
            return Marginals(ids.astype(np.int64), logp.astype(np.float64))
        depths = self._depths(k)
        if not self.sync_each_depth:
            reads = [depths.read(y)]
            while len(reads) < depth:
                y = depths.advance(reads[-1].token, y)  # the argmax stays on the device
                reads.append(depths.read(y))
            mx.eval([r.ids for r in reads], [r.logp for r in reads], committed)  # one sync for all depths
            depths.close()
            ids, logp = np.stack([np.array(r.ids) for r in reads]), np.stack([np.array(r.logp) for r in reads])
            kept = self._kept(logp[:, 0])
            return Marginals(ids[:kept].astype(np.int64), logp[:kept].astype(np.float64))
        ids_rows, logp_rows, path = [], [], 0.0
        for d in range(depth):
            read = depths.read(y)
            # one small sync a depth (k ids and values): the stop rule needs them on the host
            mx.eval(read.ids, read.logp, committed if d == 0 else [])
            ids_rows.append(np.array(read.ids))
            logp_rows.append(np.array(read.logp))
            path += float(logp_rows[-1][0])
            if d + 1 == depth or path < self.log_min_path:
                break
            y = depths.advance(read.token, y)  # the argmax stays on the device
        depths.close()
        return Marginals(np.stack(ids_rows).astype(np.int64), np.stack(logp_rows).astype(np.float64))

    def _kept(self, top1: np.ndarray) -> int:
        """How many depths the stop rule keeps of these top-1 log-probabilities: through the first
        depth where the top-1 path's log-probability falls below the bound (all if it never does),
        where the depth-by-depth loop above stops."""
        path = np.cumsum(top1.astype(np.float64))
        below = np.nonzero(path < self.log_min_path)[0]
        return int(below[0]) + 1 if below.size else len(top1)

    def observe(self, emitted: list[int]) -> None:
        self.tokens += emitted

    def skip(self, root: int, emitted: list[int]) -> None:
        """A round without a tree: the head's rows of its positions are appended, with the others
        committed since, in one pass at the next propose (MTPHead.append: 128 rows ~3 ms on the dev
        CPU), or queued now where SKIP_CATCH_UP rows are behind. A row's input is its position's
        hidden state and the token after it, so the rows are those whose next token is known: a
        pipelined round's root row is recorded before its token is (engine/round.py)."""
        self.tokens += emitted
        if not SKIP_CATCH_UP or self.features is None or not self.cache[0].offset:
            return
        known = min(self.features.length, len(self.tokens) - 1)
        if known - self.cache[0].offset >= SKIP_CATCH_UP:
            self._catch_up(known)
            mx.async_eval([a for c in self.cache for a in c.arrays()])
