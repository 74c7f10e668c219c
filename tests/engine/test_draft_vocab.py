"""The one-pass drafters' reduced vocabulary (engine/drafters/draft_vocab.py).

- `sub_logits` (the lm_head over the subset's rows only) equals the full logits' columns of those
  ids, for tied and untied output projections, float and 4/8-bit quantized (routed or not).
- Loading: the checkpoint's default size, an explicit size, 0 and the whole ranking (no subset),
  and clear errors for a missing ranking or a size out of range.
- MTP and DFlash with a small subset propose only its tokens, and the output stays plain
  decoding's (greedy and seeded); with the true continuation added to their trees, their state
  stays equal to a replay.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.config import EngineConfig, SpecConfig
from engine.drafters import BUILDERS
from engine.drafters.dflash import DFlashDrafter
from engine.drafters.draft_vocab import FILE, DraftVocab, sub_logits
from engine.drafters.mtp import MTPDrafter
from engine.generate import Engine, RequestError
from engine.loader import load_model
from engine.models.qlinear import route_quantized_projections
from engine.tree import DraftTree
from tests.engine.test_one_pass_drafters import (
    GREEDY,
    PROMPTS,
    SAMPLED,
    Assisted,
    Wrapped,
    assert_drafter_equals_replay,
    check_guess_after,
)
from tests.helpers import generate


def ranked(vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(vocab).astype(np.int32)


@pytest.mark.parametrize("quant", [None, (4, 32, False), (4, 64, True), (8, 32, True)],
                         ids=["float", "q4g32", "q4g64-routed", "q8g32-routed"])
@pytest.mark.parametrize("which", ["untied", "tied"])
def test_sub_logits_equal_the_full_logits_columns(tiny_qwen35, tiny_qwen35_cg, which, quant):
    model = load_model(tiny_qwen35 if which == "untied" else tiny_qwen35_cg, "float32").model
    if quant is not None:
        bits, group, routed = quant
        nn.quantize(model, group_size=group, bits=bits)
        if routed:
            assert route_quantized_projections(model) > 0
    V = model.args.vocab_size
    for n, seed in ((1, 0), (37, 1), (V // 2, 2), (V - 1, 3)):
        vocab = DraftVocab(mx.array(ranked(V, seed)[:n]))
        h = mx.random.normal((1, 3, model.args.hidden_size), key=mx.random.key(seed))
        want = mx.take(model.logits(h), vocab.ids, axis=-1)
        got = sub_logits(model, vocab)(h)
        assert got.shape == (1, 3, n)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def with_ranking(src, tmp_path, default_size: int | None):
    out = tmp_path / "ckpt"
    shutil.copytree(src, out)
    V = load_model(src, "float32").model.args.vocab_size
    meta = {} if default_size is None else {"default_size": str(default_size)}
    save_file({"ranked_ids": ranked(V)}, str(out / FILE), metadata=meta)
    return out, V


def test_load(tiny_qwen35, tmp_path):
    assert DraftVocab.load(tiny_qwen35) is None and DraftVocab.load(tiny_qwen35, 0) is None
    with pytest.raises(FileNotFoundError, match="draft_vocab.safetensors"):
        DraftVocab.load(tiny_qwen35, 64)
    path, V = with_ranking(tiny_qwen35, tmp_path, 100)
    order = ranked(V)
    assert np.array(DraftVocab.load(path).ids).tolist() == order[:100].tolist()
    assert np.array(DraftVocab.load(path, 7).ids).tolist() == order[:7].tolist()
    assert DraftVocab.load(path, 0) is None and DraftVocab.load(path, V) is None
    for bad in (V + 1, -3):
        with pytest.raises(ValueError, match="draft vocabulary size"):
            DraftVocab.load(path, bad)


def test_engine_and_cli_errors(tiny_qwen35_mtp, tmp_path):
    from server.cli import build_parser
    from server.cli_settings import SettingsError, engine_settings

    engine = Engine(EngineConfig(model_path=str(tiny_qwen35_mtp)))
    assert engine.draft_vocab(None) is None
    with pytest.raises(RequestError, match="draft_vocab.safetensors"):
        engine.draft_vocab(8)
    with pytest.raises(ValueError, match=">= 0"):
        SpecConfig(method="mtp", draft_vocab=-1)
    parser = build_parser()
    for flag, want in (("64", "draft_vocab.safetensors"), ("-2", "draft_vocab.safetensors")):
        with pytest.raises(SettingsError, match=want):
            engine_settings(parser.parse_args(["run", "--model", str(tiny_qwen35_mtp), "--draft-vocab", flag,
                                               "-m", "hi"]))
    path, V = with_ranking(tiny_qwen35_mtp, tmp_path, 50)
    settings = engine_settings(parser.parse_args(["run", "--model", str(path), "--spec", "mtp", "--draft-vocab",
                                                  "40", "-m", "hi"]))
    assert settings.config.spec.draft_vocab == 40
    ranked_engine = Engine(EngineConfig(model_path=str(path)))
    bound = ranked_engine.draft_vocab(None)  # the checkpoint's default, its lm_head rows gathered once
    assert bound is not None and bound.logits is not None and ranked_engine.draft_vocab(None) is bound
    assert bound.ids.shape == (50,)
    with pytest.raises(SettingsError, match="--draft-vocab: draft vocabulary size"):
        engine_settings(parser.parse_args(["run", "--model", str(path), "--draft-vocab", str(V + 5), "-m", "hi"]))


class Within(Wrapped):
    """Passes a drafter through, checking that every drafted token is in the subset."""

    def __init__(self, inner, allowed: set[int]) -> None:
        super().__init__(inner, [])
        self.allowed, self.trees = allowed, 0

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        tree = self.inner.propose(root, budget, max_depth)
        assert set(tree.tokens[1:]) <= self.allowed
        self.trees += tree.size > 1
        return tree

    def skip(self, root: int, emitted: list[int]) -> None:
        self.inner.skip(root, emitted)


@pytest.fixture(scope="module")
def engine(tiny_qwen35_mtp, tiny_dflash):
    return Engine(EngineConfig(model_path=str(tiny_qwen35_mtp), prefill_chunk=16,
                               spec=SpecConfig(dflash_model=str(tiny_dflash))))


def drafters(engine, vocab):
    yield "mtp", MTPDrafter(engine.model, engine.mtp_head(), BUILDERS["ddtree"], vocab=vocab)
    yield "dflash", DFlashDrafter(engine.model, engine.dflash_model(None), BUILDERS["ddtree"], vocab=vocab)
    yield "weaver", DFlashDrafter(engine.model, engine.dflash_model(None), BUILDERS["ddtree"],
                                  weaver=engine.weaver_trees(SpecConfig()), vocab=vocab)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_drafts_stay_in_the_subset_and_the_output_is_plain_decodings(engine, sampling):
    # the subset holds the tokens plain decoding emits (so that some guesses can be right) and others
    V = engine.model.args.vocab_size
    plain = {p[0]: generate(engine, p, sampling).tokens for p in PROMPTS}
    emitted = sorted({t for out in plain.values() for t in out})
    extra = [int(t) for t in ranked(V, 5) if t not in emitted][:40]
    vocab = DraftVocab(mx.array(emitted + extra, dtype=mx.int32))
    spec = SpecConfig(method="none", budget=10, max_depth=6, adaptive=False)
    for name, drafter in drafters(engine, vocab):
        checked = Within(drafter, set(emitted + extra))
        for prompt in PROMPTS:
            out = generate(engine, prompt, sampling, spec, checked)
            assert out.tokens == plain[prompt[0]], name
        assert checked.trees > 0, name


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_accepted_rounds_keep_the_drafters_in_step(engine, sampling):
    prompt = PROMPTS[0]
    plain = generate(engine, prompt, sampling).tokens
    vocab = DraftVocab(mx.array(ranked(engine.model.args.vocab_size, 9)[:64]))
    spec = SpecConfig(method="none", budget=10, max_depth=6, adaptive=False)
    for name, drafter in drafters(engine, vocab):
        out = generate(engine, prompt, sampling, spec, Assisted(drafter, plain, 5))
        assert out.tokens == plain, name
        assert out.stats.accepted >= 10, name
        assert_drafter_equals_replay(engine, drafter, prompt + out.tokens)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_guess_after_maps_to_the_target_vocabulary(engine, method):
    """With a subset, the on-device guess is the subset's top-1 as a target token id: the token a
    one-guess propose puts in its tree (without a subset: test_one_pass_drafters.py)."""
    check_guess_after(engine, method, DraftVocab(mx.array(ranked(engine.model.args.vocab_size, 4)[:50])))
