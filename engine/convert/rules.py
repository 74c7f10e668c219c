"""What happens to each tensor: MLX layout conventions, the Hadamard rotation, quantization.

Layout (what mlx-lm and Spruce's loader read): Qwen3.5 tensors under `language_model.`, the
conv weight [C, K, 1], zero-centred HF norms shifted by +1 (stored in fp32: 1 + w rounded to bf16
would lose most of w), MTP tensors kept under `mtp.` with the same conventions, unquantized.

Rotation (docs/hadamard.md): with the residual stream rotated by Q = D H, every projection that
reads the residual after a norm becomes W diag(w_norm) Q and the norm's weight becomes ones; every
projection that writes the residual becomes Q^T W; the embedding becomes E Q. The projections that
follow an elementwise product (o_proj, out_proj, down_proj) also get their input rotated at run
time: W R with R = D' H, and their `input_signs` D' are stored for the loader.

Quantization: affine (mx.quantize) of every 2-D projection and the embedding whose input size the
group size divides, from fp32 values (after the rotation, so no double rounding); norms, A_log,
dt_bias and conv weights stay as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

from engine import rotation
from engine.convert.source import Source, TensorInfo
from engine.models.qwen3_5 import ZERO_CENTRED_NORMS

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
READS_INPUT_NORM = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "linear_attn.in_proj_qkv",
                    "linear_attn.in_proj_z", "linear_attn.in_proj_a", "linear_attn.in_proj_b")
READS_POST_NORM = ("mlp.gate_proj", "mlp.up_proj")
WRITES_RESIDUAL = ("self_attn.o_proj", "linear_attn.out_proj", "mlp.down_proj")
FOLDED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
FINAL_NORM = "model.norm.weight"
LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
STORED_DTYPES = {"F32": mx.float32, "BF16": mx.bfloat16, "F16": mx.float16}


@dataclass(frozen=True)
class ConvertOptions:
    bits: int | None = 4  # None = keep the float weights (layout and rotation only)
    group_size: int = 64
    hadamard: bool = False
    max_shard_bytes: int = 5 << 30

    def __post_init__(self) -> None:
        if self.bits is not None and self.bits not in BITS:
            raise ValueError(f"bits must be 4 or 8 (or none), got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group size must be 32, 64 or 128, got {self.group_size}")
        if self.max_shard_bytes < 1:
            raise ValueError(f"max shard bytes must be >= 1, got {self.max_shard_bytes}")


class Rules:
    """Per-tensor conversion for one source checkpoint. `norms` holds the (shifted, fp32) norm
    weights the rotation folds into the projections after them (only with hadamard)."""

    def __init__(self, source: Source, options: ConvertOptions, norms: dict[str, mx.array]) -> None:
        self.options = options
        self.norms = norms
        self.qwen35 = source.model_type in ("qwen3_5", "qwen3_5_text")
        self.zero_centred = self.qwen35 and hf_layout(source)
        self.tied = bool(source.text_config.get("tie_word_embeddings", False))
        self.hidden = int(source.text_config["hidden_size"])
        self.residual_signs = rotation.signs(self.hidden) if options.hadamard else None
        self.quantized = self.rotated_online = 0

    def output_name(self, name: str) -> str:
        """Canonical -> MLX layout: Qwen3.5's language model lives under `language_model.`."""
        return f"language_model.{name}" if self.qwen35 and not name.startswith("mtp.") else name

    def is_norm(self, name: str, ndim: int) -> bool:
        if ndim != 1 or not name.endswith("norm.weight"):
            return False
        return name.endswith(ZERO_CENTRED_NORMS) or (name.startswith("mtp.") and "linear_attn" not in name)

    def shifted(self, name: str, w: mx.array) -> mx.array:
        """fp32 value of a tensor after the layout conventions (norm shift, conv layout)."""
        w = w.astype(mx.float32) if mx.issubdtype(w.dtype, mx.floating) else w
        if self.zero_centred and self.is_norm(name, w.ndim):
            return w + 1.0
        if name.endswith("conv1d.weight") and w.ndim == 3 and w.shape[-1] != 1:
            return w.swapaxes(1, 2)  # HF [C, 1, K] -> MLX [C, K, 1]
        return w

    def apply(self, info: TensorInfo, w: mx.array) -> list[tuple[str, mx.array]]:
        """One source tensor -> the output tensors (MLX names), lazily computed."""
        name = info.name
        if name == "lm_head.weight" and self.tied:
            return []  # tied: the embedding is the head (or, rotated, the head is made from it)
        value = self.shifted(name, w)
        if info.group == "mtp":
            return [(name, self._store(info, name, value))]
        if self.residual_signs is None:
            return self._finish(info, name, value)
        out: list[tuple[str, mx.array]] = []
        if name == "model.embed_tokens.weight" and self.tied:  # untie: the head gets the final norm folded in
            out += self._finish(info, "lm_head.weight", self._reads_residual(value, FINAL_NORM))
        return out + self._finish(info, name, self._rotated(name, value, out))

    def _rotated(self, name: str, w: mx.array, out: list[tuple[str, mx.array]]) -> mx.array:
        d = self.residual_signs
        assert d is not None
        if name == "model.embed_tokens.weight":
            return rotation.rotate(w, d)  # E Q: every embedded row lands in the rotated frame
        if name == "lm_head.weight":
            return self._reads_residual(w, FINAL_NORM)
        if name in self.norms:
            return mx.ones_like(w)  # folded into the projections that read it
        m = LAYER.fullmatch(name)
        if m is None:
            return w
        layer, module = m.groups()
        if module in READS_INPUT_NORM:
            return self._reads_residual(w, f"model.layers.{layer}.input_layernorm.weight")
        if module in READS_POST_NORM:
            return self._reads_residual(w, f"model.layers.{layer}.post_attention_layernorm.weight")
        if module in WRITES_RESIDUAL:
            w = rotation.rotate(w.T, d).T  # Q^T W: its output lands in the rotated frame
            input_signs = rotation.signs(w.shape[1])
            self.rotated_online += 1
            out.append((self.output_name(f"model.layers.{layer}.{module}.input_signs"), input_signs))
            return rotation.rotate(w, input_signs)  # W R: the loader rotates this input at run time
        return w

    def _reads_residual(self, w: mx.array, norm: str) -> mx.array:
        """W diag(w_norm) Q: the norm's scale moves into the projection, then the rotation."""
        assert self.residual_signs is not None
        return rotation.rotate(w * self.norms[norm], self.residual_signs)

    def _finish(self, info: TensorInfo, name: str, w: mx.array) -> list[tuple[str, mx.array]]:
        bits, group = self.options.bits, self.options.group_size
        quantizable = w.ndim == 2 and info.group == "text" and not name.endswith("conv1d.weight")
        if bits is None or not quantizable or w.shape[-1] % group:
            return [(self.output_name(name), self._store(info, name, w))]
        wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
        self.quantized += 1
        dtype = STORED_DTYPES.get(info.dtype, mx.float32)
        prefix = self.output_name(name[: -len(".weight")])
        return [(f"{prefix}.weight", wq), (f"{prefix}.scales", scales.astype(dtype)),
                (f"{prefix}.biases", biases.astype(dtype))]

    def _store(self, info: TensorInfo, name: str, w: mx.array) -> mx.array:
        if not mx.issubdtype(w.dtype, mx.floating) or self.is_norm(name, w.ndim) or name.endswith("A_log"):
            return w  # norms and A_log in fp32, integer tensors as they are
        return w.astype(STORED_DTYPES.get(info.dtype, mx.float32))


def hf_layout(source: Source) -> bool:
    """HF checkpoints store the conv weight [C, 1, K] (and zero-centred norms); MLX ones [C, K, 1]."""
    return any(t.name.endswith("conv1d.weight") and len(t.shape) == 3 and t.shape[-1] != 1 for t in source.tensors)


def folded_norm_names(source: Source) -> list[str]:
    """The norm weights the rotation folds into the projections after them."""
    return [t.name for t in source.tensors
            if t.group == "text" and (t.name == FINAL_NORM or (t.name.endswith(FOLDED_NORMS) and "layers." in t.name))]
