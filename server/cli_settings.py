"""How `spruce serve` and `spruce run` turn their flags (server/cli.py add_engine_args) into an
EngineConfig: model references (a directory, a Hugging Face repo id, the bundled model), `--config`
presets (a flag given on the command line wins over the preset), and `--spec auto` (the preset's
measured choice for this hardware, or plain decoding, with the reason)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, SpecConfig
from engine.hub import ModelSource

# Used when neither a flag nor the preset sets a value (the context: the model's trained length,
# at most DEFAULT_MAX_CONTEXT).
DEFAULTS: dict[str, Any] = {"dtype": "auto", "kv_dtype": "auto", "prefix_cache_bytes": 2 << 30, "spec_budget": 16,
                            "spec_depth": 0, "spec_tree": "ddtree"}
DEFAULT_MAX_CONTEXT = 8192
MAX_SPEC_BUDGET, MAX_SPEC_DEPTH = 4096, 1024
DRAFT_METHODS = ("draft", "draft-tree")


class SettingsError(Exception):
    """A flag, preset or model reference that cannot be used; printed as one line."""


@dataclass(frozen=True)
class Settings:
    config: EngineConfig
    notes: list[str] = field(default_factory=list)  # printed once the engine is up (what auto chose, why)


def engine_settings(a: argparse.Namespace) -> Settings:
    from engine import presets

    try:
        preset = presets.find(a.config) if a.config else None
    except presets.PresetError as e:
        raise SettingsError(f"--config: {e}") from None
    model_arg = a.model if a.model is not None else (preset.model if preset else None)
    model = resolve_model(model_arg, "--model")
    notes: list[str] = []
    method = a.spec or "auto"
    budget, depth, draft_arg = a.spec_budget, a.spec_depth, a.draft_model
    auto_tree = None  # the tree builder --spec auto's entry was measured with
    if method == "auto":
        choice = presets.choose_spec(preset or presets.for_model(model_arg), presets.hardware_class())
        method = choice.method
        budget = budget if budget is not None else choice.budget
        depth = depth if depth is not None else choice.depth
        draft_arg = draft_arg or choice.draft_model
        auto_tree = choice.tree
        notes.append(f"speculation: {method} (--spec auto: {choice.reason})")
    elif preset is not None and method in DRAFT_METHODS:
        draft_arg = draft_arg or preset.draft_model
    # a draft model is fetched only when it will be used (or was asked for by name)
    draft = resolve_model(draft_arg, "--draft-model") if draft_arg and (a.draft_model or method in DRAFT_METHODS) \
        else None
    budget, depth = _pick(budget, None, "spec_budget"), _pick(depth, None, "spec_depth")
    if not 1 <= budget <= MAX_SPEC_BUDGET:
        raise SettingsError(f"--spec-budget must be in [1, {MAX_SPEC_BUDGET}], got {budget}")
    if not (depth == 0 and a.spec_depth is None) and not 1 <= depth <= MAX_SPEC_DEPTH:  # 0: the method's default
        raise SettingsError(f"--spec-depth must be in [1, {MAX_SPEC_DEPTH}], got {depth}")
    max_stall = getattr(a, "spec_max_stall", None)
    if max_stall is not None and not max_stall > 1.0:
        raise SettingsError(f"--spec-max-stall must be > 1 (plain decoding steps), got {max_stall}")
    fixed = bool(getattr(a, "spec_fixed", False))
    if fixed and max_stall is not None:
        raise SettingsError("--spec-max-stall caps the trees the controller sizes; with --spec-fixed every round "
                            "drafts the full budget (drop one of the two)")
    prefix_bytes = _pick(a.prefix_cache_bytes, preset and preset.prefix_cache_bytes, "prefix_cache_bytes")
    if prefix_bytes < 0:
        raise SettingsError(f"--prefix-cache-bytes must be >= 0, got {prefix_bytes}")
    asked = a.max_context if a.max_context is not None else (preset.max_context if preset else None)
    max_context = _context(asked, trained_context(model.path), notes)
    vocab_size = getattr(a, "draft_vocab", None)
    if vocab_size:
        from engine.drafters.draft_vocab import DraftVocab

        try:
            DraftVocab.load(model.path, vocab_size)  # 32 kB: a missing file or a bad size fails here, not per request
        except (OSError, ValueError) as e:
            raise SettingsError(f"--draft-vocab: {e}") from None
    try:
        spec = SpecConfig(method=method, budget=budget, max_depth=depth, draft_model=str(draft.path) if draft else None,
                          draft_vocab=vocab_size, max_stall=max_stall, adaptive=not fixed,
                          tree=_pick(getattr(a, "spec_tree", None), auto_tree, "spec_tree"),
                          dflash_model=_drafter_dir(getattr(a, "dflash_model", None), "--dflash-model"),
                          weaver_model=_drafter_dir(getattr(a, "weaver_model", None), "--weaver-model"))
        config = EngineConfig(
            model_path=str(model.path), model_id=model.name, max_context=max_context,
            dtype=_pick(a.dtype, preset and preset.dtype, "dtype"), spec=spec, prefix_cache=not a.no_prefix_cache,
            prefix_cache_bytes=prefix_bytes, kv_dtype=_pick(getattr(a, "kv_dtype", None), None, "kv_dtype"))
    except ValueError as e:
        raise SettingsError(str(e)) from None
    return Settings(config, notes)


def _context(asked: int | None, trained: int | None, notes: list[str]) -> int:
    """The context length: as asked (warned past the trained length), else the trained length, at
    most DEFAULT_MAX_CONTEXT."""
    if asked is None:
        return min(DEFAULT_MAX_CONTEXT, trained or DEFAULT_MAX_CONTEXT)
    if asked < 2:
        raise SettingsError(f"--max-context must be >= 2, got {asked}")
    if trained is not None and asked > trained:
        notes.append(f"warning: --max-context {asked} is longer than the {trained} tokens the model was trained "
                     "on; answers past that length may degrade")
    return asked


def trained_context(model: Path) -> int | None:
    """max_position_embeddings of the checkpoint (nested text_config first), if it says."""
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader reports a broken config.json
    if not isinstance(cfg, dict):
        return None
    for section in (cfg.get("text_config"), cfg):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def _drafter_dir(arg: str | None, flag: str) -> str | None:
    """A drafter directory (DFlash, Weaver): it must hold a config.json."""
    if arg is None:
        return None
    path = Path(arg).expanduser()
    if not path.is_dir():
        raise SettingsError(f"{flag} {arg}: no such directory")
    if not (path / "config.json").is_file():
        raise SettingsError(f"{flag} {arg}: not a checkpoint directory (missing config.json)")
    return str(path)


def _pick(flag: Any, preset_value: Any, key: str) -> Any:
    if flag is not None:
        return flag
    return preset_value if preset_value is not None else DEFAULTS[key]


def resolve_model(arg: str | None, flag: str) -> ModelSource:
    """None = the bundled target; 'bundled:NAME' = a bundled checkpoint; a directory; a repo id."""
    from engine.hub import HubError, resolve
    from engine.presets import BUNDLED_PREFIX, bundled_path

    if arg is None or arg.startswith(BUNDLED_PREFIX):
        path = bundled_path(arg or BUNDLED_PREFIX + "target")
        if not (path / "config.json").is_file():
            which = "" if path.name == "target" else f"{path.name} "
            raise SettingsError(f"no bundled {which}model in this install; pass {flag} DIR")
        return ModelSource(path=path, name=path.name)
    path = Path(arg).expanduser()
    if path.is_dir():
        missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
        if missing:
            raise SettingsError(f"{flag} {arg}: not a checkpoint directory (missing {', '.join(missing)})")
        return ModelSource(path=path, name=path.resolve().name)
    try:
        return resolve(arg)
    except HubError as e:
        raise SettingsError(f"{flag} {e}") from None
