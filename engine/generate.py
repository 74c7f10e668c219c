"""The engine and its single-slot loop: prefill, then rounds of draft -> verify -> accept -> commit.

Plain decoding is the same loop with a one-node tree (the root), so there is exactly one decode
path to keep correct; engine/round.py holds the round.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx

from engine import blas, half_weights
from engine.cache import KVCache, LayerCache
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.drafters import make_drafter
from engine.drafters.base import Drafter, ReadsTarget
from engine.drafters.draft_vocab import DraftVocab
from engine.drafters.weaver import WeaverTrees
from engine.dtypes import KV_DTYPES, resolve_kv_dtype
from engine.embedding import embed_step
from engine.feature_cache import FeatureCache, FeatureTaps
from engine.grammar import GrammarError, GrammarState, GrammarTokenizer
from engine.loader import CheckpointError, load_dflash, load_model, load_mtp, load_weaver, mtp_files
from engine.memory import MemoryReport, cache_nbytes
from engine.models import dflash
from engine.models.base import CausalLM
from engine.prefill import CheckpointRule, Prefiller, default_prefill_chunk
from engine.prefix_cache import PrefixCache
from engine.round import InFlight, Rounds, Sequence
from engine.sampling_defaults import read_sampling_defaults
from engine.spec_control import RoundCosts
from engine.tokenizer import Tokenizer
from engine.types import GenerationRequest, Stats, Step, TokenLogprob


class RequestError(ValueError):
    """A request the engine cannot run (bad token ids, too long for the context)."""


class Engine:
    """Owns the model, its caches and the drafters. Call generate() from one thread only."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = load_model(config.model_path, config.dtype)
        self.model: CausalLM = loaded.model
        self.dtype, self.weights_bytes, self.last_cache_bytes = loaded.dtype, loaded.nbytes, 0
        # the target's K/V storage (None: as computed); a setting of the engine, read by make_cache
        kv = resolve_kv_dtype(config.kv_dtype, loaded.dtype, loaded.stored_dtype)
        self.kv_dtype: mx.Dtype | None = None if kv == loaded.dtype else KV_DTYPES[kv]
        self.load_notes = loaded.notes  # printed by the CLI at start
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.model_id = config.model_id or Path(config.model_path).resolve().name
        self.vocab_size = self.model.args.vocab_size
        self._draft_models: dict[str, CausalLM] = {}
        self._draft_bytes = 0
        self._dflash_models: dict[str, dflash.DFlashModel] = {}
        self._draft_vocabs: dict[int | None, DraftVocab | None] = {}
        self._mtp_head = None
        self._weavers: dict[str, WeaverTrees] = {}
        # Hidden states every pass records for the drafters that read them (DFlash, MTP): decided
        # once, so that every cache and prefix snapshot of this engine has the same layout.
        self.feature_taps = self._feature_taps()
        attention_only = all(self.model.args.layer_is_attention)
        self.prefix = PrefixCache(config.prefix_cache_bytes, config.prefix_cache, trimmable=attention_only)
        self.checkpoints = CheckpointRule.of(self.tokenizer, config.snapshot_every)
        self.prefill_chunk = config.prefill_chunk or default_prefill_chunk()
        self.prefiller = Prefiller(self.prefix, self.checkpoints, self.prefill_chunk)
        self._draft_prefillers: dict[int, Prefiller] = {}
        self.sampling_defaults = read_sampling_defaults(Path(config.model_path))
        # what each speculation setting's trees cost, learnt from its requests (engine/spec_control.py)
        self.round_costs: dict[SpecConfig, RoundCosts] = {}
        self._grammar_tokenizer: GrammarTokenizer | None = None

    def draft_model(self, path: str | None) -> CausalLM:
        """The draft model at `path` (or the configured / bundled default), loaded once."""
        path = path or self.config.spec.draft_model or default_draft_for(self.config.model_path)
        if path is None:
            raise RequestError("spec method 'draft' needs a draft model (--draft-model DIR)")
        key = str(Path(path).resolve())
        if key not in self._draft_models:
            loaded = load_model(path, self.config.dtype)
            model = loaded.model
            if model.args.vocab_size != self.vocab_size:
                raise RequestError(f"draft model {path} has vocab {model.args.vocab_size}, "
                                   f"the target {self.vocab_size}: they must share the tokenizer")
            self._draft_models[key] = model
            self._draft_bytes += loaded.nbytes
        return self._draft_models[key]

    def memory(self) -> MemoryReport:
        return MemoryReport(self.dtype, self.weights_bytes, self._draft_bytes, self.last_cache_bytes,
                            self.prefix.nbytes + sum(p.prefix.nbytes for p in self._draft_prefillers.values()),
                            half_weights.copies_bytes())

    def _feature_taps(self) -> FeatureTaps:
        """The hidden states the configured drafters read: the default spec method's, and those of a
        DFlash drafter named explicitly. Recording costs every pass (12 % of plain decoding on the
        bundled model on the CPU), so nothing else is recorded until a request needs it (widen_taps)."""
        spec, taps = self.config.spec, FeatureTaps()
        if spec.method == "mtp" and mtp_files(self.config.model_path):
            taps = FeatureTaps(final=True)  # the final-normed state feeds the MTP head
        if spec.method == "dflash" or spec.dflash_model is not None:
            taps = taps.union(self._dflash_taps(self._dflash_path(None)))
            if spec.tree == "weaver" or spec.weaver_model is not None:
                taps = taps.union(FeatureTaps(final=True))  # Weaver's prompt starts with it
        return taps

    @staticmethod
    def _dflash_taps(path: str | None) -> FeatureTaps:
        if path is None:
            return FeatureTaps()
        try:
            return FeatureTaps(tuple(set(dflash.read_config(path).target_layer_ids)))
        except dflash.DFlashConfigError as e:
            raise CheckpointError(str(e)) from None

    def widen_taps(self, taps: FeatureTaps) -> None:
        """Record `taps` too from now on. The prefix cache's snapshots lack the new rows, so they
        are dropped: the first request of a drafter that reads new taps prefills its prompt anew."""
        if not self.feature_taps.covers(taps):
            self.feature_taps = self.feature_taps.union(taps)
            self.prefix.clear()

    def make_cache(self) -> list[LayerCache]:
        """The target's layer caches, and a FeatureCache when drafters read hidden states."""
        features: list[LayerCache] = [FeatureCache(self.feature_taps)] if self.feature_taps.count else []
        caches = self.model.make_cache()
        for c in caches:
            if isinstance(c, KVCache):
                c.dtype, c.headroom = self.kv_dtype, True
        return caches + features

    def dflash_model(self, path: str | None) -> dflash.DFlashModel:
        """The DFlash drafter at `path` (or the configured / bundled one), loaded once."""
        path = self._dflash_path(path)
        if path is None:
            raise RequestError("spec method 'dflash' needs a DFlash checkpoint (--dflash-model DIR)")
        key = str(Path(path).resolve())
        if key not in self._dflash_models:
            self._dflash_models[key] = load_dflash(path, self.dtype)
        return self._dflash_models[key]

    def mtp_head(self):
        """The target checkpoint's MTP head, loaded once."""
        if not mtp_files(self.config.model_path):
            raise RequestError(f"spec method 'mtp' needs MTP tensors (mtp.*) in {self.config.model_path}")
        if self._mtp_head is None:
            self._mtp_head = load_mtp(self.config.model_path, self.model.args, self.dtype)
        return self._mtp_head

    def draft_vocab(self, size: int | None) -> DraftVocab | None:
        """The one-pass drafters' reduced vocabulary of `size` tokens (SpecConfig.draft_vocab), loaded
        and its lm_head rows gathered once per size; None: the whole vocabulary."""
        if size not in self._draft_vocabs:
            try:
                vocab = DraftVocab.load(self.config.model_path, size)
                self._draft_vocabs[size] = None if vocab is None else vocab.bound(self.model)
            except (OSError, ValueError) as e:
                raise RequestError(f"draft vocabulary: {e}") from None
        return self._draft_vocabs[size]

    def missing_drafter(self, method: str, tree: str) -> str | None:
        """Why a spec method / tree cannot run on this engine, or None. Reads no weights (the
        server calls it off the engine thread)."""
        if method == "mtp" and not mtp_files(self.config.model_path):
            return f"spec method 'mtp' needs a model with an MTP head (mtp.* tensors); {self.model_id} has none"
        if method == "mtp" and tree == "weaver":
            return "the weaver tree builder re-scores DFlash blocks: use it with spec method 'dflash'"
        if method == "dflash" and self._dflash_path(None) is None:
            return "spec method 'dflash' needs a server started with --dflash-model"
        if method == "dflash" and tree == "weaver" and self._weaver_path(None) is None:
            return "spec tree 'weaver' needs a Weaver adapter (--weaver-model, or DFLASH_DIR/weaver)"
        return None

    def _dflash_path(self, path: str | None) -> str | None:
        return path or self.config.spec.dflash_model or default_dflash_for(self.config.model_path)

    def _weaver_path(self, path: str | None) -> str | None:
        """The Weaver adapter: given, configured, or the `weaver` directory beside the DFlash drafter."""
        if path or self.config.spec.weaver_model:
            return path or self.config.spec.weaver_model
        dflash_dir = self._dflash_path(None)
        if dflash_dir is not None and (Path(dflash_dir) / "weaver" / "config.json").is_file():
            return str(Path(dflash_dir) / "weaver")
        return None

    def weaver_trees(self, spec: SpecConfig) -> WeaverTrees:
        """The Weaver tree builder for spec tree 'weaver' (adapter and its vocabulary tables
        built once; the builder keeps no per-request state)."""
        path = self._weaver_path(spec.weaver_model)
        if path is None:
            raise RequestError("spec tree 'weaver' needs a Weaver adapter (--weaver-model DIR)")
        key = str(Path(path).resolve())
        if key not in self._weavers:
            self._weavers[key] = WeaverTrees(load_weaver(path, self.dtype), self.model)
        return self._weavers[key]

    def check_request(self, req: GenerationRequest) -> None:
        ids = req.prompt_ids
        if not ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of range [0, {self.vocab_size})")
        biased = [t for t, _ in req.sampling.logit_bias if t >= self.vocab_size]
        if biased:
            raise RequestError(f"logit_bias token id {biased[0]} is out of range [0, {self.vocab_size})")
        if len(ids) >= self.config.max_context:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context holds {self.config.max_context}")

    def generate(self, req: GenerationRequest, drafter: Drafter | None = None) -> Iterator[Step]:
        """Run one request; `drafter` overrides the one the spec settings pick (tests, benchmarks).
        Checks and drafter set-up happen here, eagerly; decoding when the iterator is consumed."""
        self.check_request(req)
        if req.embed:
            blas.pace(host_busy=False)  # a prefill: the host waits for it
            return iter([embed_step(self.model, req.prompt_ids, self.prefill_chunk)])
        spec = req.spec or self.config.spec
        eos = () if req.sampling.ignore_eos else self.tokenizer.eos_token_ids
        params = dataclasses.replace(
            req.sampling, stop_token_ids=tuple(sorted(set(req.sampling.stop_token_ids) | set(eos))))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        grammar = self.grammar_state(params.grammar) if params.grammar is not None else None
        drafter = drafter or make_drafter(self, spec)
        if isinstance(drafter, ReadsTarget):
            self.widen_taps(drafter.taps)
        return self._run(req, params, seed, spec, drafter, grammar)

    def grammar_state(self, grammar: str) -> GrammarState:
        """A fresh state of `grammar` over this model's tokenizer (built on first use)."""
        try:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = GrammarTokenizer(Path(self.config.model_path) / "tokenizer.json",
                                                           self.vocab_size, self.tokenizer.eos_token_ids)
            return self._grammar_tokenizer.state(grammar)
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def _run(self, req: GenerationRequest, params: SamplingParams, seed: int, spec: SpecConfig,
             drafter: Drafter, grammar: GrammarState | None = None) -> Iterator[Step]:
        stats = Stats(prompt_tokens=len(req.prompt_ids))
        t_start = time.perf_counter()
        blas.pace(host_busy=False)  # the prefill: the host waits for it
        cache, stats.cached_tokens = self._prefill(req.prompt_ids[:-1])
        if isinstance(drafter, ReadsTarget):
            features = cache[-1]
            assert isinstance(features, FeatureCache) and features.taps.covers(drafter.taps)
            drafter.attach(features)
        drafter.begin(req.prompt_ids)  # a draft model's prefill is part of the prompt's time too
        stats.prompt_ms = _ms_since(t_start)
        n = len(req.prompt_ids)
        seq = Sequence(tokens=list(req.prompt_ids), covered=n - 1, prompt_len=n,
                       end=min(n + params.max_tokens, self.config.max_context))
        # a tree's cost does not depend on the budget the request allows (its arms are the same
        # sizes) nor on a stall cap: one memory for them all, and few keys whatever requests ask
        costs = self.round_costs.setdefault(dataclasses.replace(spec, budget=1, max_stall=None), RoundCosts())
        rounds = Rounds(self.model, cache, seq, params, seed, spec, drafter, stats, grammar, costs=costs)
        try:
            yield from self._decode(req, params, rounds, seq, stats, t_start)
        finally:
            self.last_cache_bytes = cache_nbytes(cache)
            # whatever ended the request, the caches hold seq.tokens[:covered], unless an interrupt
            # came between a pipelined launch and its landing (the caches are then one token ahead)
            if seq.covered <= len(seq.tokens):
                self.prefix.store(cache, seq.tokens[: seq.covered], "generation")

    def _decode(self, req: GenerationRequest, params: SamplingParams, rounds: Rounds, seq: Sequence,
                stats: Stats, t_start: float) -> Iterator[Step]:
        flight: InFlight | None = None
        while True:
            if req.cancel.is_set():
                yield self._final([], "cancelled", stats, t_start)
                return
            room = seq.end - len(seq.tokens)
            if room <= 0:
                yield self._final([], "length", stats, t_start)
                return
            flight = flight or rounds.launch(room)
            # pipelined: queue the next round before this one's token reaches the host
            ahead = rounds.launch_after(flight) if room > 1 and rounds.can_pipeline(flight) else None
            result = rounds.land(flight)
            if stats.forward_passes == 1:
                stats.ttft_ms = _ms_since(t_start)
            tokens, logprobs = list(result.tokens), result.logprobs
            if tokens[-1] in params.stop_token_ids:
                yield self._final(tokens[:-1], "stop", stats, t_start, logprobs and logprobs[:-1])
                return
            if len(tokens) >= room:
                yield self._final(tokens[:room], "length", stats, t_start, logprobs and logprobs[:room])
                return
            yield Step(token_ids=tokens, logprobs=logprobs)
            if ahead is not None:
                rounds.start(ahead)  # a no-op where it started at launch (see engine/round.py)
            flight = ahead

    def _prefill(self, ids: list[int]) -> tuple[list[LayerCache], int]:
        """Fresh caches holding `ids` (the prompt but its last token), through the prefix cache
        (engine/prefill.py: snapshots at turns, FIM markers, every N tokens and the end)."""
        cache = self.make_cache()
        return cache, self.prefiller.fill(self.model, cache, ids)

    def draft_prefiller(self, model: CausalLM) -> Prefiller:
        """A draft model's own prefix cache (a quarter of the target's budget): its prefill of a
        repeated prompt is skipped too."""
        key = id(model)
        if key not in self._draft_prefillers:
            attention_only = all(model.args.layer_is_attention)
            prefix = PrefixCache(self.config.prefix_cache_bytes // 4, self.config.prefix_cache,
                                 trimmable=attention_only)
            self._draft_prefillers[key] = Prefiller(prefix, self.checkpoints, self.prefill_chunk)
        return self._draft_prefillers[key]

    def _final(self, tokens: list[int], reason: str, stats: Stats, t_start: float,
               logprobs: list[TokenLogprob] | None = None) -> Step:
        stats.decode_ms = _ms_since(t_start) - stats.prompt_ms
        return Step(token_ids=tokens, finish_reason=reason, stats=stats, logprobs=logprobs)


BUNDLED = Path(__file__).resolve().parent / "bundled"


def default_draft_for(model_path: str) -> str | None:
    """The bundled target comes with a bundled draft model."""
    target, draft = BUNDLED / "target", BUNDLED / "draft"
    if Path(model_path).resolve() == target.resolve() and (draft / "config.json").is_file():
        return str(draft)
    return None


def default_dflash_for(model_path: str) -> str | None:
    """The bundled target comes with a bundled DFlash drafter."""
    target, drafter = BUNDLED / "target", BUNDLED / "dflash"
    if Path(model_path).resolve() == target.resolve() and (drafter / "config.json").is_file():
        return str(drafter)
    return None


def _ms_since(t: float) -> float:
    return (time.perf_counter() - t) * 1e3
