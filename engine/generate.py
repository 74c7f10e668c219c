"""The single-slot generation loop: prefill, then rounds of draft -> verify -> accept -> commit.

Plain decoding is the same loop with a one-node tree (the root), so there is exactly one
decode path to keep correct.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine import sampler, verify
from engine.cache import commit_all
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.drafters import make_drafter
from engine.drafters.base import Drafter, NoDrafter
from engine.loader import load_model
from engine.logits_extras import token_logprobs
from engine.prefix_cache import PrefixCache, restore
from engine.tokenizer import Tokenizer
from engine.tree import DraftTree
from engine.types import GenerationRequest, Stats, Step


class RequestError(ValueError):
    """A request the engine cannot run (bad token ids, too long for the context)."""


class Engine:
    """Owns the model, its caches and the drafters. Call generate() from one thread only."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = load_model(config.model_path, config.dtype)
        self.model = loaded.model
        self.loaded = loaded
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.model_id = Path(config.model_path).resolve().name
        self.vocab_size = self.model.args.vocab_size
        self._draft_models: dict[str, object] = {}
        attention_only = all(self.model.args.layer_is_attention)
        self.prefix = PrefixCache(config.prefix_cache_bytes, config.prefix_cache, trimmable=attention_only)
        self.boundary_id = self.tokenizer.token_id("<|im_start|>")

    def draft_model(self, path: str | None):
        """The draft model at `path` (or the configured / bundled default), loaded once."""
        path = path or self.config.spec.draft_model or default_draft_for(self.config.model_path)
        if path is None:
            raise RequestError("spec method 'draft' needs a draft model (--draft-model DIR)")
        key = str(Path(path).resolve())
        if key not in self._draft_models:
            model = load_model(path, self.config.dtype).model
            if model.args.vocab_size != self.vocab_size:
                raise RequestError(f"draft model {path} has vocab {model.args.vocab_size}, "
                                   f"the target {self.vocab_size}: they must share the tokenizer")
            self._draft_models[key] = model
        return self._draft_models[key]

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
        """Run one request; `drafter` overrides the one the spec settings pick (tests, benchmarks)."""
        self.check_request(req)
        spec = req.spec or self.config.spec
        eos = () if req.sampling.ignore_eos else self.tokenizer.eos_token_ids
        params = dataclasses.replace(
            req.sampling, stop_token_ids=tuple(sorted(set(req.sampling.stop_token_ids) | set(eos))))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        return self._run(req, params, seed, spec, drafter or make_drafter(self, spec))

    def _run(self, req, params: SamplingParams, seed: int, spec: SpecConfig, drafter: Drafter) -> Iterator[Step]:
        stats = Stats(prompt_tokens=len(req.prompt_ids))
        t_start = time.perf_counter()
        cache, stats.cached_tokens = self._start(req.prompt_ids[:-1])
        stats.prompt_ms = _ms_since(t_start)
        drafter.begin(req.prompt_ids)
        run = _Run(seq=list(req.prompt_ids), covered=len(req.prompt_ids) - 1, prompt_len=len(req.prompt_ids))
        pipelined = isinstance(drafter, NoDrafter) and params.greedy and not params.adjusts_logits \
            and params.logprobs is None
        rounds = self._plain_greedy if pipelined else self._rounds
        try:
            yield from rounds(req, params, seed, spec, drafter, cache, stats, run, t_start)
        finally:  # the committed state is consistent whatever ended the request
            self.prefix.store(cache, run.seq[: run.covered])

    def _rounds(self, req, params, seed, spec, drafter, cache, stats, run, t_start) -> Iterator[Step]:
        produced = 0
        while True:
            if req.cancel.is_set():
                yield self._final([], "cancelled", stats, t_start)
                return
            room = min(params.max_tokens - produced, self.config.max_context - run.covered - 1)
            if room <= 0:
                yield self._final([], "length", stats, t_start)
                return
            acc, logits = self._round(run, cache, params, seed, spec, drafter, stats, room)
            tokens = list(acc.tokens)
            logprobs = None if params.logprobs is None else \
                token_logprobs(logits[list(acc.path)], tokens, params.logprobs)
            produced += len(tokens)
            if tokens[-1] in params.stop_token_ids:
                yield self._final(tokens[:-1], "stop", stats, t_start, logprobs and logprobs[:-1])
                return
            if len(tokens) >= room:
                yield self._final(tokens[:room], "length", stats, t_start, logprobs and logprobs[:room])
                return
            yield Step(token_ids=tokens, logprobs=logprobs)

    def _round(self, run, cache, params, seed, spec, drafter, stats, room):
        """draft -> verify -> accept -> commit, on the committed context run.seq[:run.covered]."""
        t0 = time.perf_counter()
        root, committed = run.seq[-1], run.covered
        budget = min(spec.budget, room - 1)
        tree = drafter.propose(root, budget, spec.max_depth) if budget > 0 else DraftTree.single(root)
        t1 = time.perf_counter()
        logits = verify.verify(self.model, cache, tree, committed)
        t2 = time.perf_counter()
        acc = sampler.accept(tree, logits, params, seed, committed, run.seq[run.prompt_len :])
        verify.commit(cache, list(acc.path))
        t3 = time.perf_counter()
        run.covered += len(acc.path)
        run.seq += acc.tokens
        drafter.observe(list(acc.tokens))  # counted as drafting: the drafter syncs its own state
        stats.forward_passes += 1
        stats.drafted += tree.size - 1
        stats.accepted += len(acc.path) - 1
        stats.draft_ms += (t1 - t0 + time.perf_counter() - t3) * 1e3
        stats.verify_ms += (t2 - t1) * 1e3
        stats.commit_ms += (t3 - t2) * 1e3
        stats.generated_tokens += len(acc.tokens)
        if stats.forward_passes == 1:
            stats.ttft_ms = stats.prompt_ms + (t3 - t0) * 1e3
        return acc, logits

    def _plain_greedy(self, req, params, seed, spec, drafter, cache, stats, run, t_start) -> Iterator[Step]:
        """Plain greedy decoding, pipelined like mlx-lm's generate_step: the next one-node verify
        is queued (async_eval) before the current token is read, so building its graph overlaps
        the compute. Same verify and commit as a round; the argmax runs on the device. The root
        of a one-node tree is always accepted, so its commit needs no host round trip."""

        def launch(token: mx.array) -> mx.array:
            tree = verify.tree_batch(DraftTree.single(0), run.covered)
            logits = self.model(token.reshape(1, 1), cache, tree)[0, 0]
            commit_all(cache, [0])
            run.covered += 1
            y = mx.argmax(logits).astype(mx.int32)
            mx.async_eval(y)
            return y

        room = min(params.max_tokens, self.config.max_context - run.covered - 1)
        if room <= 0:
            yield self._final([], "length", stats, t_start)
            return
        y, produced = launch(mx.array([run.seq[-1]])), 0
        while True:
            t0 = time.perf_counter()
            if req.cancel.is_set():
                yield self._final([], "cancelled", stats, t_start)
                return
            produced += 1
            nxt = launch(y) if produced < room else None
            token = y.item()
            run.seq.append(token)
            stats.verify_ms += _ms_since(t0)
            stats.forward_passes += 1
            stats.generated_tokens += 1
            if produced == 1:
                stats.ttft_ms = _ms_since(t_start)
            if token in params.stop_token_ids:
                yield self._final([], "stop", stats, t_start)
                return
            if nxt is None:
                yield self._final([token], "length", stats, t_start)
                return
            yield Step(token_ids=[token])
            y = nxt

    def _start(self, ids: list[int]) -> tuple[list, int]:
        """Fresh caches holding `ids` (the prompt but its last token): resume from the prefix
        cache, prefill the rest in chunks, snapshot at chat-message boundaries and at the end."""
        cache = self.model.make_cache()
        snap, cached = self.prefix.lookup(ids)
        if snap is not None:
            restore(snap, cache, cached)
        cuts = [p for p in range(cached + 1, len(ids)) if ids[p] == self.boundary_id][-2:]
        start = cached
        for stop in [*cuts, len(ids)]:
            verify.extend(self.model, cache, ids[start:stop], self.config.prefill_chunk)
            self.prefix.store(cache, ids[:stop])
            start = stop
        return cache, cached

    def _final(self, tokens: list[int], reason: str, stats: Stats, t_start: float, logprobs=None) -> Step:
        stats.decode_ms = _ms_since(t_start) - stats.prompt_ms
        return Step(token_ids=tokens, finish_reason=reason, stats=stats, logprobs=logprobs)


BUNDLED = Path(__file__).resolve().parent / "bundled"


def default_draft_for(model_path: str) -> str | None:
    """The bundled target comes with a bundled draft model."""
    target, draft = BUNDLED / "target", BUNDLED / "draft"
    if Path(model_path).resolve() == target.resolve() and (draft / "config.json").is_file():
        return str(draft)
    return None


@dataclass
class _Run:
    """The sequence so far (prompt + emitted; its last token is the next root) and how many of
    its tokens the caches hold."""

    seq: list[int]
    covered: int
    prompt_len: int  # seq[prompt_len:] is what this completion generated (penalties look at it)


def _ms_since(t: float) -> float:
    return (time.perf_counter() - t) * 1e3
