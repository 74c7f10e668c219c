"""The source checkpoint as the converter sees it: its config and, from the safetensors headers
alone (no tensor is read), every tensor's file, dtype and shape."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.drafters.draft_vocab import FILE as DRAFT_VOCAB_FILE
from engine.loader import CheckpointError, canonical_key, read_config, tensor_group

HEADER_LIMIT = 100 << 20  # a safetensors header larger than this is not a header


@dataclass(frozen=True)
class TensorInfo:
    key: str  # the name in the file
    name: str  # the canonical name (engine.loader.canonical_key)
    group: str  # text | mtp | vision
    file: Path
    dtype: str  # safetensors dtype: BF16, F32, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        size = 1
        for d in self.shape:
            size *= d
        return size * {"F64": 8, "F32": 4, "I32": 4, "U32": 4, "I64": 8}.get(self.dtype, 2 if "16" in self.dtype else 1)


@dataclass(frozen=True)
class Source:
    path: Path
    raw_config: dict  # config.json as written
    model_type: str
    text_config: dict  # nested text_config merged over the top level (engine.loader.read_config)
    tensors: tuple[TensorInfo, ...]

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors})

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}


def open_source(path: Path) -> Source:
    model_type, text = read_config(path)
    raw = json.loads((path / "config.json").read_text())
    # the draft vocabulary beside a checkpoint is not weights: it is copied as it is (run.py)
    files = sorted(f for f in path.glob("*.safetensors") if f.name != DRAFT_VOCAB_FILE)
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weight files")
    tensors = [info for f in files for info in _header(f)]
    return Source(path, raw, model_type, text, tuple(tensors))


def _header(file: Path) -> list[TensorInfo]:
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > HEADER_LIMIT:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"cannot read the safetensors header of {file.name}: {e}") from None
    header.pop("__metadata__", None)
    out = []
    for key, meta in header.items():
        name = canonical_key(key)
        out.append(TensorInfo(key, name, tensor_group(name), file, meta["dtype"], tuple(meta["shape"])))
    return out
