"""Drafters propose draft trees; see base.py for the protocol."""

from __future__ import annotations

from engine.config import SpecConfig
from engine.drafters.base import Drafter, NoDrafter
from engine.drafters.draft_chain import ChainDraftDrafter
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.ngram import NgramDrafter


def make_drafter(engine, spec: SpecConfig) -> Drafter:
    if spec.method == "none":
        return NoDrafter()
    if spec.method == "ngram":
        return NgramDrafter()
    if spec.method == "draft":
        return ChainDraftDrafter(engine.draft_model(spec.draft_model))
    if spec.method == "draft-tree":
        return DraftModelDrafter(engine.draft_model(spec.draft_model))
    raise ValueError(f"unknown spec method {spec.method!r}")
