"""`spruce convert` (HF checkpoint -> MLX layout, 4/8-bit, optional Hadamard rotation) and
`spruce models` (the shipped presets and what is in the local Hugging Face cache)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from server.cli_settings import SettingsError, resolve_model


def add_convert_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert an HF checkpoint to MLX layout, quantized (4/8-bit) and optionally "
                                       "Hadamard-rotated")
    p.add_argument("src", help="HF checkpoint: directory or Hugging Face repo id (org/name[@revision])")
    p.add_argument("out", help="output directory (new, or empty)")
    p.add_argument("--bits", choices=("4", "8", "none"), default="4",
                   help="affine quantization of the projections and the embedding (default 4; none = keep floats)")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64,
                   help="weights per quantization scale (default 64)")
    p.add_argument("--hadamard", action="store_true",
                   help="rotate by block-diagonal Hadamard transforms (size 32) before quantizing: folded into the "
                        "weights, plus a run-time rotation of the inputs of o_proj / out_proj / down_proj "
                        "(Spruce only: mlx-lm refuses such a checkpoint)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="largest output file in GB (default 5)")


def add_models_parser(sub) -> None:
    sub.add_parser("models", help="list the presets (--config NAME) and the models in the local Hugging Face cache")


def cmd_convert(a: argparse.Namespace) -> int:
    from engine.convert import ConvertError, ConvertOptions, convert

    try:
        options = ConvertOptions(bits=None if a.bits == "none" else int(a.bits), group_size=a.group_size,
                                 hadamard=a.hadamard, max_shard_bytes=int(a.shard_gb * 1e9))
    except ValueError as e:
        raise SettingsError(str(e)) from None
    src = resolve_model(a.src, "SRC").path
    try:
        report = convert(src, Path(a.out), options, progress=True)
    except ConvertError as e:
        raise SettingsError(str(e)) from None
    what = "floats kept" if options.bits is None else f"{report.quantized} tensors quantized to {options.bits}-bit " \
                                                       f"(group {options.group_size})"
    lines = [f"wrote {a.out}: {len(report.files)} weight file(s), {report.bytes_out / 1e6:.1f} MB "
             f"(from {report.bytes_in / 1e6:.1f} MB), {what}"]
    if options.hadamard:
        lines.append(f"Hadamard rotation folded into the weights; {report.rotated_online} projection inputs rotated "
                     "at run time (loads in Spruce, not in mlx-lm)")
    if report.mtp_kept:
        lines.append(f"kept {report.mtp_kept} MTP tensors (unquantized{', not rotated' if options.hadamard else ''})")
    if report.vision_skipped:
        lines.append(f"skipped {report.vision_skipped} vision tensors (Spruce serves text)")
    print("\n".join(lines), file=sys.stderr)
    return 0


def cmd_models(a: argparse.Namespace) -> int:
    from huggingface_hub import constants

    from engine import presets
    from engine.hub import cached_models
    from engine.models import FAMILIES

    hardware = presets.hardware_class()
    try:
        shipped = presets.shipped()
    except presets.PresetError as e:
        raise SettingsError(str(e)) from None
    print(f"presets (spruce serve --config NAME); speculation with --spec auto on this machine ({hardware}):")
    rows = [(p.name, p.model, _spec_summary(p, hardware)) for p in shipped.values()]
    _table(["name", "model", f"spec on {hardware}"], rows)
    cached = cached_models()
    print(f"\nHugging Face cache ({constants.HF_HUB_CACHE}):")
    if not cached:
        print("  (empty)")
        return 0
    cache_rows = [(m.repo_id, f"{m.size_bytes / 1e9:.2f} GB", ", ".join(m.revisions),
                   (m.model_type or "no config.json") + ("" if m.model_type in FAMILIES else " (not supported)"))
                  for m in cached]
    _table(["repo", "size", "revisions", "model type"], cache_rows)
    return 0


def _spec_summary(preset, hardware: str) -> str:
    from engine.presets import choose_spec

    entry = preset.spec.get(hardware)
    choice = choose_spec(preset, hardware)
    if choice.method != "none":
        trees = f", {choice.tree} trees" if choice.tree else ""
        return f"{choice.method} (budget {choice.budget}, depth {choice.depth}{trees}): measured {entry.speedup:.2f}x"
    if entry is not None and not entry.measured:
        return f"none ({entry.method} not measured yet)"
    return "none" + (f" ({entry.method} measured {entry.speedup:.2f}x)" if entry is not None else " (no entry)")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
