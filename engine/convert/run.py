"""The conversion, one source file at a time: a file's tensors are read lazily, converted and
evaluated one by one and written out in shards, so memory holds about one output shard plus one
tensor in fp32 (and, with --hadamard, the model's norm weights)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import mlx.core as mx
from mlx.utils import tree_flatten

from engine import rotation
from engine.convert.rules import ConvertOptions, Rules, folded_norm_names
from engine.convert.source import Source, open_source
from engine.convert.writer import ShardWriter
from engine.drafters.draft_vocab import FILE as DRAFT_VOCAB_FILE
from engine.loader import CheckpointError
from engine.models import FAMILIES

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
SKIPPED_FILES = ("config.json", "model.safetensors.index.json")
SMALL_FILE_LIMIT = 64 << 20


class ConvertError(ValueError):
    """A source or an output that cannot be converted; the message says which and why."""


@dataclass
class ConvertReport:
    out: Path
    files: list[Path] = field(default_factory=list)
    tensors_in: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    quantized: int = 0  # projections quantized
    rotated_online: int = 0  # projections whose input is rotated at run time
    mtp_kept: int = 0
    vision_skipped: int = 0


def convert(src: Path, out: Path, options: ConvertOptions, progress: bool = True) -> ConvertReport:
    try:
        source = open_source(src)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    _check_source(source, options)
    _prepare_out(out)
    try:
        return _convert(source, out, options, progress)
    except BaseException:  # a failed or interrupted conversion leaves no half-written checkpoint
        shutil.rmtree(out, ignore_errors=True)
        raise


def _convert(source: Source, out: Path, options: ConvertOptions, progress: bool) -> ConvertReport:
    rules = Rules(source, options, _folded_norms(source) if options.hadamard else {})
    report = ConvertReport(out=out)
    writer = ShardWriter(out, options.max_shard_bytes)
    kept = [t for t in source.tensors if t.group != "vision"]
    report.vision_skipped = len(source.tensors) - len(kept)
    bar = _progress(sum(t.nbytes for t in kept), progress)
    for file in source.files:
        arrays = _load(file)  # lazy: a tensor is read when its output is evaluated
        for info in (t for t in kept if t.file == file):
            outputs = rules.apply(info, arrays.pop(info.key))
            try:
                mx.eval([a for _, a in outputs])
            except (RuntimeError, ValueError) as e:  # a truncated or corrupt file
                raise ConvertError(f"cannot read tensor {info.key!r} from {file.name}: {e}") from None
            writer.add(outputs)
            report.tensors_in += 1
            report.bytes_in += info.nbytes
            report.mtp_kept += info.group == "mtp"
            bar.update(info.nbytes)
        del arrays
    bar.close()
    report.files = writer.close()
    report.bytes_out = sum(f.stat().st_size for f in report.files)
    report.quantized, report.rotated_online = rules.quantized, rules.rotated_online
    _write_config(source, out, options, rules)
    _copy_small_files(source.path, out)
    return report


def _check_source(source: Source, options: ConvertOptions) -> None:
    names = {t.name for t in source.tensors}
    if any(n.endswith(".scales") for n in names):
        raise ConvertError(f"{source.path} is already quantized; convert an unquantized (bf16/fp16/fp32) checkpoint")
    family = FAMILIES[source.model_type]
    try:
        args = family.args_from_config(source.text_config)
    except KeyError as e:
        raise ConvertError(f"{source.path / 'config.json'}: missing key {e.args[0]!r}") from None
    expected = {k for k, _ in cast(list[tuple[str, mx.array]], tree_flatten(family.Model(args).parameters()))}
    text = {t.name for t in source.tensors if t.group == "text"}
    missing = sorted(expected - text)
    if missing:
        raise ConvertError(f"{source.path}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if options.hadamard:
        _check_rotatable(source, args)


def _check_rotatable(source: Source, args) -> None:
    sizes = {"hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
             "attention heads x head_dim": args.num_attention_heads * args.head_dim}
    if not all(args.layer_is_attention):
        sizes["linear value heads x dim"] = args.linear_num_value_heads * args.linear_value_head_dim
    bad = {k: v for k, v in sizes.items() if v % rotation.BLOCK}
    if bad:
        name, size = next(iter(bad.items()))
        raise ConvertError(f"--hadamard needs sizes divisible by {rotation.BLOCK}; this model's {name} is {size}")


def _folded_norms(source: Source) -> dict[str, mx.array]:
    """The shifted fp32 norm weights the rotation folds away (small: one vector per norm)."""
    rules = Rules(source, ConvertOptions(bits=None), {})
    by_name = source.by_name()
    out = {}
    for file in source.files:
        wanted = [n for n in folded_norm_names(source) if by_name[n].file == file]
        if wanted:
            arrays = _load(file)
            out.update({n: rules.shifted(n, arrays[by_name[n].key]) for n in wanted})
    mx.eval(list(out.values()))
    return out


def _load(file: Path) -> dict[str, mx.array]:
    try:
        return cast(dict[str, mx.array], mx.load(str(file)))
    except (RuntimeError, ValueError) as e:  # truncated or not safetensors
        raise ConvertError(f"cannot read {file.name}: {e}") from None


def _prepare_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out} already exists and is not an empty directory")
    out.mkdir(parents=True, exist_ok=True)


def _write_config(source: Source, out: Path, options: ConvertOptions, rules: Rules) -> None:
    cfg = dict(source.raw_config)
    if cfg.get("model_type") == "qwen3_5_text":
        cfg["model_type"] = "qwen3_5"  # what mlx-lm reads (a flat config is its text config)
    if options.bits is not None:
        quant = {"group_size": options.group_size, "bits": options.bits, "mode": "affine"}
        cfg["quantization"] = quant
        cfg["quantization_config"] = dict(quant)  # the key HF hub tooling reads
    if options.hadamard:
        if rules.tied:  # the head now has the final norm folded in: it is its own tensor
            cfg["tie_word_embeddings"] = False
            if isinstance(cfg.get("text_config"), dict):
                cfg["text_config"] = {**cfg["text_config"], "tie_word_embeddings": False}
        cfg["spruce_rotation"] = {
            "kind": "block-hadamard", "block": rotation.BLOCK, "sign_seed": rotation.SIGN_SEED,
            "residual": "folded into the weights (embedding, projections, head; norm weights are ones)",
            "online": "inputs of the projections that store input_signs",
            "mtp": "not rotated" if any(t.group == "mtp" for t in source.tensors) else "none",
        }
    (out / "config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _copy_small_files(src: Path, out: Path) -> None:
    """Tokenizer, generation config, chat template, README, the draft vocabulary...: everything but
    weights and config. (The draft vocabulary merged into the weights made mlx-lm refuse the
    checkpoint: its `ranked_ids` is no parameter of the model.)"""
    for f in sorted(src.iterdir()):
        side_file = f.name == DRAFT_VOCAB_FILE
        if (f.is_file() and f.name not in SKIPPED_FILES and (side_file or not f.name.endswith(WEIGHT_SUFFIXES))
                and f.stat().st_size <= SMALL_FILE_LIMIT):
            shutil.copyfile(f, out / f.name)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="converting", disable=not enabled)
