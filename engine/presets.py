"""Named presets (configs/*.toml): a model, its engine settings, and per hardware class the
speculation that was measured to pay there (or a candidate marked `measured = false`).

`--spec auto` reads them: it picks the preset's method for this machine's hardware class only when
a side-by-side measurement recorded in the preset says it is faster than plain decoding; with no
such measurement it decodes plainly and says why. Unknown keys are errors (our own files).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import DTYPE_NAMES, SPEC_METHODS, SPEC_TREES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

HARDWARE_CLASSES = ("cpu", "apple-gpu", "nvidia-gpu")
BUNDLED_PREFIX = "bundled:"  # model = "bundled:target" names a checkpoint shipped in engine/bundled/
ENGINE_DIR = Path(__file__).resolve().parent


class PresetError(ValueError):
    """A preset file that is not valid; the message names the file and the key."""


@dataclass(frozen=True)
class SpecEntry:
    """The speculation of a preset on one hardware class, and the measurement behind it."""

    method: str
    budget: int = 16
    depth: int = 0  # 0: the method's default (engine.config.METHOD_DEPTHS)
    tree: str | None = None  # tree builder of the one-pass drafters (mtp, dflash); None = the CLI's default
    draft_model: str | None = None  # None = the preset's draft_model
    measured: bool = False
    speedup: float | None = None  # median decode tok/s ratio to plain decoding, measured side by side
    tokens_per_forward: float | None = None
    distinct_8grams: float | None = None  # share of distinct 8-grams of the output (1.0 = no repetition)
    source: str | None = None  # where the measurement is written up (BENCHMARKS.md section, command, date)
    note: str | None = None

    @property
    def pays(self) -> bool:
        return self.measured and self.method != "none" and self.speedup is not None and self.speedup > 1.0


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model: str  # a repo id, a directory, or "bundled:NAME"
    path: Path  # the TOML file
    draft_model: str | None = None
    source_model: str | None = None  # the unquantized HF checkpoint, for `spruce convert`
    max_context: int | None = None
    dtype: str | None = None
    prefix_cache_bytes: int | None = None
    spec: dict[str, SpecEntry] = field(default_factory=dict)  # hardware class -> entry


@dataclass(frozen=True)
class SpecChoice:
    """What `--spec auto` resolved to, and why (printed by the CLI)."""

    method: str
    budget: int
    depth: int
    draft_model: str | None
    reason: str
    tree: str | None = None  # None: the CLI's default (--spec-tree)


def configs_dir() -> Path:
    """configs/ beside the package in a source checkout; engine/configs/ in an installed wheel."""
    for candidate in (ENGINE_DIR.parent / "configs", ENGINE_DIR / "configs"):
        if candidate.is_dir():
            return candidate
    raise PresetError("no configs/ folder found next to the engine package")


def shipped() -> dict[str, Preset]:
    """Every preset in configs/, by name."""
    presets = [load_file(p) for p in sorted(configs_dir().glob("*.toml"))]
    by_name = {p.name: p for p in presets}
    if len(by_name) != len(presets):
        raise PresetError("two presets in configs/ share a name")
    return by_name


def find(name_or_file: str) -> Preset:
    """A shipped preset by name, or a TOML file by path."""
    path = Path(name_or_file).expanduser()
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise PresetError(f"config file {name_or_file} does not exist")
        return load_file(path)
    presets = shipped()
    if name_or_file not in presets:
        raise PresetError(f"no preset named {name_or_file!r} (shipped: {', '.join(sorted(presets))}; "
                          "or pass a .toml file)")
    return presets[name_or_file]


def for_model(model: str | None) -> Preset | None:
    """The shipped preset that serves this --model (None = the bundled model), if any."""
    wanted = _model_key(model if model is not None else BUNDLED_PREFIX + "target")
    return next((p for p in shipped().values() if _model_key(p.model) == wanted), None)


def _model_key(model: str) -> str:
    if model.startswith(BUNDLED_PREFIX):
        return str(bundled_path(model).resolve())
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path.resolve())
    return model.partition("@")[0].lower()


def bundled_path(model: str) -> Path:
    """'bundled:target' -> engine/bundled/target."""
    return ENGINE_DIR / "bundled" / model[len(BUNDLED_PREFIX):]


def choose_spec(preset: Preset | None, hardware: str) -> SpecChoice:
    """--spec auto: the preset's measured method for this hardware class if it pays, else none."""
    if preset is None:
        return SpecChoice("none", 16, 8, None, "no preset describes this model, so no measurement says "
                                               "speculation pays: plain decoding")
    entry = preset.spec.get(hardware)
    if entry is None:
        return SpecChoice("none", 16, 8, None, f"preset {preset.name!r} has no entry for {hardware}: plain decoding")
    if not entry.measured:
        return SpecChoice("none", entry.budget, entry.depth, None,
                          f"{entry.method} is not measured on {hardware} for preset {preset.name!r}: plain decoding")
    if not entry.pays:
        return SpecChoice("none", entry.budget, entry.depth, None,
                          f"{entry.method} was measured at {entry.speedup:.2f}x on {hardware} for preset "
                          f"{preset.name!r}, no faster than plain decoding: plain decoding")
    trees = f" with {entry.tree} trees" if entry.tree else ""
    return SpecChoice(entry.method, entry.budget, entry.depth, entry.draft_model or preset.draft_model,
                      f"measured {entry.speedup:.2f}x plain decoding{trees} on {hardware} for preset {preset.name!r}",
                      entry.tree)


def hardware_class() -> str:
    """cpu, apple-gpu (Metal) or nvidia-gpu (CUDA): where this process computes by default."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    return "apple-gpu" if mx.metal.is_available() else "nvidia-gpu"


# --- reading and checking a file -----------------------------------------------------------------

PRESET_KEYS = {"name": str, "description": str, "model": str, "draft_model": str, "source_model": str,
               "max_context": int, "dtype": str, "prefix_cache_bytes": int, "spec": dict}
SPEC_KEYS = {"method": str, "budget": int, "depth": int, "tree": str, "draft_model": str, "measured": bool,
             "speedup": (int, float), "tokens_per_forward": (int, float), "distinct_8grams": (int, float),
             "source": str, "note": str}


def load_file(path: Path) -> Preset:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise PresetError(f"cannot read {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"{path}: not valid TOML: {e}") from None
    _check_keys(data, PRESET_KEYS, str(path))
    for key in ("name", "description", "model"):
        if key not in data:
            raise PresetError(f"{path}: missing key {key!r}")
    if data.get("dtype", "auto") not in DTYPE_NAMES:
        raise PresetError(f"{path}: dtype must be one of {', '.join(DTYPE_NAMES)}, got {data['dtype']!r}")
    for key in ("max_context", "prefix_cache_bytes"):
        if key in data and data[key] < 1:
            raise PresetError(f"{path}: {key} must be >= 1, got {data[key]}")
    spec = {hw: _spec_entry(entry, f"{path} [spec.{hw}]") for hw, entry in data.pop("spec", {}).items()}
    unknown = sorted(set(spec) - set(HARDWARE_CLASSES))
    if unknown:
        raise PresetError(f"{path}: unknown hardware class {unknown[0]!r} (known: {', '.join(HARDWARE_CLASSES)})")
    return Preset(path=path, spec=spec, **data)


def _spec_entry(raw: Any, where: str) -> SpecEntry:
    if not isinstance(raw, dict):
        raise PresetError(f"{where}: must be a table")
    _check_keys(raw, SPEC_KEYS, where)
    if raw.get("method") not in SPEC_METHODS:
        raise PresetError(f"{where}: method must be one of {', '.join(SPEC_METHODS)}, got {raw.get('method')!r}")
    if "tree" in raw and (raw["tree"] not in SPEC_TREES or raw.get("method") not in ("mtp", "dflash")):
        raise PresetError(f"{where}: tree must be one of {', '.join(SPEC_TREES)}, for method mtp or dflash "
                          f"(got tree {raw['tree']!r} with method {raw.get('method')!r})")
    if raw.get("measured", False):
        missing = [k for k in ("speedup", "tokens_per_forward", "source") if k not in raw]
        if missing:
            raise PresetError(f"{where}: a measured entry needs {missing[0]!r}")
    else:
        invented = [k for k in ("speedup", "tokens_per_forward", "distinct_8grams") if k in raw]
        if invented:
            raise PresetError(f"{where}: {invented[0]!r} given but measured = false")
    for key in ("budget", "depth"):
        if key in raw and raw[key] < 1:
            raise PresetError(f"{where}: {key} must be >= 1, got {raw[key]}")
    return SpecEntry(**raw)


def _check_keys(data: dict, schema: dict[str, Any], where: str) -> None:
    for key, value in data.items():
        if key not in schema:
            raise PresetError(f"{where}: unknown key {key!r}")
        expected = schema[key]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise PresetError(f"{where}: {key} has the wrong type ({type(value).__name__})")
