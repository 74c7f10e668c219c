"""Drafters propose draft trees; see base.py for the protocol."""

from __future__ import annotations

from engine.config import SpecConfig
from engine.drafters.base import Drafter, NoDrafter
from engine.drafters.draft_chain import DraftChainDrafter
from engine.drafters.draft_tree import DraftTreeDrafter
from engine.drafters.ngram import NgramDrafter


def make_drafter(engine, spec: SpecConfig) -> Drafter:
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
    raise ValueError(f"unknown spec method {spec.method!r}")
