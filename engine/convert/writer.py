"""Output shards: tensors are written as they come, a file whenever the pending ones pass the
shard size; at the end the files get their final names (model.safetensors, or
model-0000i-of-0000n.safetensors with an HF index)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx


class ShardWriter:
    def __init__(self, out: Path, max_shard_bytes: int) -> None:
        self.out = out
        self.max_bytes = max_shard_bytes
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: list[tuple[str, mx.array]]) -> None:
        for name, array in tensors:
            if name in self.pending or any(name in names for _, names in self.parts):
                raise ValueError(f"tensor {name} written twice")
            self.pending[name] = array
            self.pending_bytes += array.nbytes
        if self.pending_bytes >= self.max_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        part = self.out / f"part-{len(self.parts) + 1:05d}.safetensors"
        mx.save_safetensors(str(part), self.pending, metadata={"format": "mlx"})
        self.parts.append((part, list(self.pending)))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write what is pending, name the files, write the index. -> the weight files."""
        self._flush()
        if len(self.parts) == 1:
            final = self.out / "model.safetensors"
            self.parts[0][0].rename(final)
            return [final]
        files, weight_map = [], {}
        for i, (part, names) in enumerate(self.parts):
            final = self.out / f"model-{i + 1:05d}-of-{len(self.parts):05d}.safetensors"
            part.rename(final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return files
