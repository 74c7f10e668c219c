"""Drafters propose draft trees; see base.py for the protocol."""

from __future__ import annotations

from engine.config import SpecConfig
from engine.drafters import marginals
from engine.drafters.base import Drafter, NoDrafter
from engine.drafters.dflash import DFlashDrafter, TreeBuilder
from engine.drafters.draft_chain import DraftChainDrafter
from engine.drafters.draft_tree import DraftTreeDrafter
from engine.drafters.mtp import MTPConfig, MTPDrafter
from engine.drafters.ngram import NgramDrafter

BUILDERS: dict[str, TreeBuilder] = {"chain": marginals.chain, "ddtree": marginals.ddtree}
# the class make_drafter builds for each spec method: what a tool may ask of a method's drafter
# (e.g. whether it has hindsight) without loading a model
DRAFTER_TYPES: dict[str, type] = {"none": NoDrafter, "ngram": NgramDrafter, "draft": DraftChainDrafter,
                                  "draft-tree": DraftTreeDrafter, "dflash": DFlashDrafter, "mtp": MTPDrafter}


def make_drafter(engine, spec: SpecConfig) -> Drafter:
    drafter = _build(engine, spec)
    # DRAFTER_TYPES answers for this function without building: every test of a method checks it
    assert isinstance(drafter, DRAFTER_TYPES[spec.method]), (spec.method, type(drafter))
    return drafter


def _build(engine, spec: SpecConfig) -> Drafter:
    if spec.method == "none":
        return NoDrafter()
    if spec.method == "ngram":
        return NgramDrafter()
    if spec.method == "draft":
        model = engine.draft_model(spec.draft_model)
        return DraftChainDrafter(model, fill=engine.draft_prefiller(model).fill)
    if spec.method == "draft-tree":
        model = engine.draft_model(spec.draft_model)
        return DraftTreeDrafter(model, fill=engine.draft_prefiller(model).fill)
    if spec.method == "dflash":
        model = engine.dflash_model(spec.dflash_model)
        vocab = engine.draft_vocab(spec.draft_vocab)
        if spec.tree == "weaver":
            return DFlashDrafter(engine.model, model, marginals.ddtree, weaver=engine.weaver_trees(spec), vocab=vocab)
        return DFlashDrafter(engine.model, model, BUILDERS[spec.tree], vocab=vocab, top1_chains=spec.tree == "chain")
    if spec.method == "mtp":
        if spec.tree == "weaver":
            raise ValueError("the weaver tree builder re-scores DFlash blocks: use it with spec method 'dflash'")
        vocab = engine.draft_vocab(spec.draft_vocab)
        return MTPDrafter(engine.model, engine.mtp_head(), BUILDERS[spec.tree], MTPConfig(max_steps=spec.max_depth),
                          vocab=vocab, top1_chains=spec.tree == "chain")
    raise ValueError(f"unknown spec method {spec.method!r}")
