"""Checkpoint directory -> model (+ tokenizer).

Two layouts are read:
- HF (`save_pretrained`): config.json, maybe with a nested `text_config`; safetensors with
  `model.*` or `model.language_model.*` names; conv1d weight [C, 1, K]; zero-centred RMSNorms
  stored as w and applied as (1 + w). Vision (`model.visual.*`) and MTP (`mtp.*`) tensors are
  skipped and reported.
- MLX (mlx-community / mlx-lm): `language_model.model.*` names, conv1d [C, K, 1], norms already
  shifted, optional affine `quantization` block (group size 32/64/128, 4/8 bit), and from
  `spruce convert --hadamard` the `input_signs` of projections whose inputs are rotated at run
  time (engine/rotation.py).

Weights load one file at a time: the tensors of a file are read, converted to the compute dtype and
evaluated before the next file is read, so a checkpoint is never held twice (stored dtype and
compute dtype) in memory. When the compute dtype is the stored one nothing is copied.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine import cpu_ext, half_weights
from engine.dtypes import DTYPES, resolve_dtype
from engine.kernels import backend_default
from engine.memory import physical_memory
from engine.models import FAMILIES
from engine.models.base import ModelArgs
from engine.models.linear import hold_views
from engine.models.qlinear import dequantize_projections, float32_bytes, route_quantized_projections
from engine.rotation import rotate_inputs_of

SKIPPED_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "mtp.", "model.mtp.")
# kept in float32 whatever the compute dtype: A_log feeds an exp, and the gated norm's weight
# multiplies an fp32 normalisation (stored in the compute dtype it was cast back every call: one
# launch a GDN layer on a GPU)
KEEP_FP32 = ("A_log", "linear_attn.norm.weight")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and key."""


@dataclass
class LoadedModel:
    model: nn.Module
    config: dict  # the text config the model was built from
    path: Path
    skipped: dict[str, int] = field(default_factory=dict)  # prefix -> count of tensors ignored
    quantization: dict | None = None
    dtype: str = "float32"  # the compute dtype the float weights were loaded in
    stored_dtype: str | None = None  # the float dtype most of the checkpoint's float values were stored in
    rotated_inputs: int = 0  # projections whose inputs are Hadamard-rotated at run time
    fused_projections: int = 0  # groups of same-input projections run as one matmul
    routed_projections: int = 0  # quantized projections on the engine's matmul (engine/models/qlinear.py)
    dequantized_projections: int = 0  # quantized projections turned float32 on the CPU (cpu_dequantize)
    half_weights: int = 0  # float32 weights the CPU multiplies by from bfloat16 copies (engine/half_weights.py)

    @property
    def notes(self) -> tuple[str, ...]:
        """What a user starting the engine should know about how the checkpoint was loaded."""
        if not self.dequantized_projections:
            return ()
        bits = (self.quantization or {}).get("bits", "?")
        return (f"the {bits}-bit checkpoint's {self.dequantized_projections} quantized projections run in float32 "
                f"on the CPU ({self.nbytes / 1e9:.2f} GB of weights; SPRUCE_CPU_DEQUANT=0 keeps them quantized, "
                "several times slower)",)

    @property
    def nbytes(self) -> int:
        """Bytes of all weights as loaded (quantized ones packed)."""
        return model_nbytes(self.model)


def model_nbytes(model: nn.Module) -> int:
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return sum(v.nbytes for _, v in params)


def read_config(path: Path) -> tuple[str, dict]:
    """-> (model_type, text config). Nested text_config is merged over the top level."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json (is it a checkpoint directory?)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    model_type = cfg.get("model_type")
    text = dict(cfg)
    if isinstance(cfg.get("text_config"), dict):
        text.update(cfg["text_config"])
        if "tie_word_embeddings" in cfg:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"{cfg_file}: unsupported model_type {model_type!r} (supported: {', '.join(sorted(FAMILIES))})")
    text["model_type"] = model_type
    return model_type, text


def _read_tensors(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weight files")
    tensors, origin = {}, {}
    for f in files:
        try:
            loaded = mx.load(str(f))
        except Exception as e:  # a truncated or foreign file
            raise CheckpointError(f"cannot read {f.name}: {e}") from None
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{f.name} holds no named tensors")
        for k, v in loaded.items():
            tensors[k] = v
            origin[k] = f.name
    return tensors, origin


def canonical_key(key: str) -> str:
    """A checkpoint key (HF, HF ForConditionalGeneration, MLX) -> our parameter name
    (`model.layers.N...`, `lm_head.weight`; vision and MTP keys keep their own prefixes)."""
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("language_model.", "")):
        if key.startswith(old):
            return new + key[len(old):]
    return key


def tensor_group(name: str) -> str:
    """'text' (what the language model loads), 'mtp' or 'vision', for a canonical name."""
    if not name.startswith(SKIPPED_PREFIXES):
        return "text"
    return "mtp" if "mtp." in name else "vision"


def _canonical_name(key: str) -> str | None:
    """Map a checkpoint key to our parameter name; None = skip (vision, MTP)."""
    name = canonical_key(key)
    return name if tensor_group(name) == "text" else None


def _skip_group(key: str) -> str:
    return tensor_group(canonical_key(key))


def _canonical(tensors: dict[str, mx.array], origin: dict[str, str],
               loaded: LoadedModel) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Checkpoint names -> our parameter names; skipped groups are counted in `loaded`."""
    out, where = {}, {}
    for key, value in tensors.items():
        name = _canonical_name(key)
        if name is None:
            group = _skip_group(key)
            loaded.skipped[group] = loaded.skipped.get(group, 0) + 1
            continue
        out[name], where[name] = value, origin[key]
    return out, where


def _rotate(model: nn.Module, weights: dict[str, mx.array]) -> int:
    suffix = ".input_signs"
    return rotate_inputs_of(model, sorted(k[: -len(suffix)] for k in weights if k.endswith(suffix)))


def _quantize(model: nn.Module, cfg: dict, weights: dict[str, mx.array]) -> dict | None:
    q = cfg.get("quantization")
    if not q:
        return None
    if q.get("mode", "affine") != "affine":
        raise CheckpointError(f"quantization mode {q.get('mode')!r} is not supported (only affine)")

    def predicate(p: str, m: nn.Module):
        if p in q and isinstance(q[p], dict):
            return q[p]
        return hasattr(m, "to_quantized") and f"{p}.scales" in weights

    nn.quantize(model, group_size=q["group_size"], bits=q["bits"], class_predicate=predicate)
    return q


def _check_and_cast(model: nn.Module, weights: dict[str, mx.array], where: dict[str, str],
                    path: Path, dtype) -> list[tuple[str, mx.array]]:
    expected = dict(tree_flatten(model.parameters()))
    missing = [k for k in expected if k not in weights]
    if missing:
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r} (expected shape "
                              f"{tuple(expected[missing[0]].shape)}); {len(missing)} missing in all")
    out = []
    for name, ref in expected.items():
        w = weights[name]
        if tuple(w.shape) != tuple(ref.shape):
            raise CheckpointError(f"{where.get(name, '?')}: tensor {name!r} has shape {tuple(w.shape)}, "
                                  f"expected {tuple(ref.shape)}")
        if mx.issubdtype(w.dtype, mx.floating):
            w = w.astype(mx.float32 if name.endswith(KEEP_FP32) else dtype)
        out.append((name, w))
    return out


def _stored_float_dtype(weights) -> str | None:
    """The name (DTYPES) of the float dtype holding most of these tensors' float values, if any."""
    sizes: dict[str, int] = {}
    for w in weights:
        name = next((n for n, d in DTYPES.items() if w.dtype == d), None)
        if name is not None:
            sizes[name] = sizes.get(name, 0) + w.size
    return max(sizes, key=lambda n: sizes[n]) if sizes else None


def load_model(path: str | Path, dtype: str = "auto", fuse: bool | None = None,
               routed: bool | None = None, dequantize: bool | None = None) -> LoadedModel:
    """dtype: a name of engine.config.DTYPE_NAMES ('auto' = bfloat16 on a GPU, float32 on the CPU).
    fuse: run each layer's same-input projections as one matmul (engine/models/fused.py); None =
    SPRUCE_FUSE (0 / 1) if set, else on CUDA only, where it was measured: on the CPU OpenBLAS ran
    the stacked one-row products slower than the separate ones (bundled model, gate|up: 454 us
    against 206 for the two), and no Apple GPU was reachable to measure Metal.
    routed: route the quantized projections through the engine's matmul (the small-M tensor-core
    kernel on CUDA, dequantize + GEMM for many rows on the CPU); None = SPRUCE_QMM (0 / 1) if set,
    else on CUDA and the CPU, where each was measured (engine/models/qlinear.py).
    dequantize: turn quantized projections into float32 ones at load (CPU only); None = cpu_dequantize."""
    fuse = switch("SPRUCE_FUSE") if fuse is None else fuse
    routed = switch("SPRUCE_QMM", on=("cuda", "cpu")) if routed is None else routed
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    try:
        dtype = resolve_dtype(dtype)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    model_type, cfg = read_config(path)
    family = FAMILIES[model_type]
    try:
        args = family.args_from_config(cfg)
    except KeyError as e:
        raise CheckpointError(f"{path / 'config.json'}: missing key {e.args[0]!r}") from None
    model = family.Model(args)
    loaded = LoadedModel(model=model, config=cfg, path=path, dtype=dtype)
    tensors, origin = _read_tensors(path)
    weights, where = _canonical(tensors, origin, loaded)
    del tensors  # from here on only the lazy graph of each final weight refers to the file's arrays
    weights = model.sanitize(weights)
    loaded.stored_dtype = _stored_float_dtype(weights.values())
    loaded.rotated_inputs = _rotate(model, weights)
    loaded.quantization = _quantize(model, cfg, weights)
    final = _check_and_cast(model, weights, where, path, DTYPES[dtype])
    del weights
    _evaluate_by_file(final, where)
    model.load_weights(final, strict=True)
    del final  # the model holds the weights now; fusing below frees each original it replaces
    mx.eval(model.parameters())  # nothing left to compute; a guard against a lazy parameter
    # float32 weights for float32 activations only (a bf16 request on the CPU keeps its kernels)
    if loaded.quantization is not None and dtype == "float32" and (
            cpu_dequantize(model) if dequantize is None else dequantize):
        loaded.dequantized_projections = dequantize_projections(model)
    if fuse and hasattr(model, "fuse_projections"):
        loaded.fused_projections = model.fuse_projections()
    if routed:
        loaded.routed_projections = route_quantized_projections(model)
    hold_views(model)  # last: the weights are final
    loaded.half_weights = half_weights.register_module(model)
    if mx.default_device() == mx.cpu:
        cpu_ext.module()  # the CPU's own operations built now (once per user, ~7 s), not in a first request
    return loaded


# On the CPU a quantized checkpoint is turned float32 at load while that takes at most this share of
# the machine's memory (SPRUCE_CPU_DEQUANT=0 | 1 overrides): MLX's CPU quantized kernels are far
# slower than a float32 GEMV (engine/models/qlinear.py dequantize_projections). A 4-bit Qwen3.5-0.8B
# grows to ~3.2 GB, a 4B to ~16 GB.
CPU_DEQUANT_MEMORY_SHARE = 0.4


def cpu_dequantize(model: nn.Module) -> bool:
    """Whether to turn the model's quantized projections float32 at load: never on a GPU; on the
    CPU as SPRUCE_CPU_DEQUANT (0 | 1) says, else where the float32 weights fit in
    CPU_DEQUANT_MEMORY_SHARE of the memory."""
    choice = os.environ.get("SPRUCE_CPU_DEQUANT") or None  # set but empty: as if unset
    if choice not in (None, "0", "1"):
        raise CheckpointError(f"SPRUCE_CPU_DEQUANT must be 0 or 1, got {choice!r}")
    if mx.default_device() != mx.cpu:
        return False
    if choice is not None:
        return choice == "1"
    return float32_bytes(model) <= CPU_DEQUANT_MEMORY_SHARE * physical_memory()


def switch(name: str, on: tuple[str, ...] = ("cuda",)) -> bool:
    """A loader choice that is on by default on the backends `on` names
    (engine.kernels.backend_default), or what the environment variable `name` (0 | 1) says."""
    try:
        return backend_default(name, on)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _evaluate_by_file(final: list[tuple[str, mx.array]], where: dict[str, str]) -> None:
    """Evaluate the weights one checkpoint file at a time: a file's stored arrays are freed once
    its converted weights exist, so memory holds the converted model plus at most one file."""
    by_file: dict[str, list[mx.array]] = {}
    for name, w in final:
        by_file.setdefault(where.get(name, ""), []).append(w)
    for arrays in by_file.values():
        mx.eval(arrays)


# ---- drafters that live beside a target: the MTP head inside its checkpoint, DFlash checkpoints

MTP_PREFIXES = ("model.language_model.mtp.", "language_model.mtp.", "model.mtp.", "mtp.")


def safetensors_keys(file: Path) -> list[str]:
    """Tensor names of a safetensors file, from its JSON header only (no tensor is read)."""
    try:
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the header of {file.name}: {e}") from None
    return [k for k in header if k != "__metadata__"]


def _mtp_name(key: str) -> str | None:
    return next((key[len(p):] for p in MTP_PREFIXES if key.startswith(p)), None)


def mtp_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files that hold MTP tensors (HF shards, or a separate
    mtp.safetensors as some quantized repos ship)."""
    return [f for f in sorted(Path(path).glob("*.safetensors")) if any(_mtp_name(k) for k in safetensors_keys(f))]


def load_mtp(path: str | Path, args: ModelArgs, dtype: str = "float32", fuse: bool | None = None):
    """The MTP head of the checkpoint at `path`, for the target of `args`. fuse: its same-input
    projections as one matmul each (MTPHead.fuse_projections); None = SPRUCE_FUSE if set, else off.
    Off by default on every backend, CUDA too: on the H200 (the 9B-wide head, bf16) six depths
    queued as the drafter runs them took 2.68 ms fused against 2.66 separate, two heads side by side
    in one process (`scripts/profile_mtp.py --compare-fuse`; BENCHMARKS.md, issue 12, twenty-second
    session): a depth's host cost is not in its few matmuls."""
    from engine.models.mtp import MTPHead

    path = Path(path)
    files = mtp_files(path)
    if not files:
        raise CheckpointError(f"{path} has no MTP tensors (mtp.*)")
    tensors, origin = {}, {}
    for f in files:
        loaded = mx.load(str(f))
        assert isinstance(loaded, dict)
        for key, value in loaded.items():
            name = _mtp_name(key)
            if name is not None:
                tensors[name], origin[name] = value, f.name
    layers = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("layers."))
    head = MTPHead(args, layers)
    tensors = head.sanitize(tensors)
    _, cfg = read_config(path)
    _quantize(head, cfg, tensors)
    _fill(head, tensors, origin, path, dtype)
    if switch("SPRUCE_FUSE", on=()) if fuse is None else fuse:
        head.fuse_projections()
    hold_views(head)
    half_weights.register_module(head)
    return head


def _fill(module: nn.Module, tensors: dict[str, mx.array], origin: dict[str, str], path: Path, dtype: str) -> None:
    """Load a drafter's checked weights in the compute dtype and evaluate them."""
    module.load_weights(_check_and_cast(module, tensors, origin, path, DTYPES[resolve_dtype(dtype)]), strict=True)
    mx.eval(module.parameters())


def load_dflash(path: str | Path, dtype: str = "float32"):
    """A DFlash draft checkpoint as z-lab publishes it (engine/models/dflash.py)."""
    from engine.models.dflash import DFlashConfigError, DFlashModel
    from engine.models.dflash import read_config as read_dflash_config

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"DFlash directory {str(path)!r} does not exist")
    try:
        config = read_dflash_config(path)
    except DFlashConfigError as e:
        raise CheckpointError(str(e)) from None
    model = DFlashModel(config)
    tensors, origin = _read_tensors(path)
    cfg = json.loads((path / "config.json").read_text())
    _quantize(model, cfg, tensors)
    _fill(model, tensors, origin, path, dtype)
    hold_views(model)
    half_weights.register_module(model)
    return model


def load_weaver(path: str | Path, dtype: str = "float32"):
    """A Weaver adapter converted by scripts/convert_weaver.py (engine/models/weaver.py)."""
    from engine.models.weaver import Weaver, WeaverConfigError
    from engine.models.weaver import read_config as read_weaver_config

    path = Path(path)
    try:
        config = read_weaver_config(path)
    except WeaverConfigError as e:
        raise CheckpointError(str(e)) from None
    model = Weaver(config)
    tensors, origin = _read_tensors(path)
    _fill(model, tensors, origin, path, dtype)
    hold_views(model)
    half_weights.register_module(model)
    return model
