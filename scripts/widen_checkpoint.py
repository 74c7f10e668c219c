"""The bundled target, its MTP head and its DFlash drafter widened to a real Qwen3.5 shape: a
checkpoint that costs what a 9B step costs and says what the bundled model says.

    python scripts/widen_checkpoint.py OUT [--shape 9b|test|mid] [--target DIR] [--dflash DIR] [--bits 4|8]

Why: on a GPU the bundled target (hidden 384, 8 layers) is launch-bound, a step ~1 ms of small
kernels, so a verify, a draft pass or a step all cost about the same and speculation cannot pay
(BENCHMARKS.md, issue 12). A real 9B step reads ~17 GB of bf16 weights; no trained drafter for a
real shape exists in this project (nothing can be downloaded). Zero-padding the bundled models to
the 9B shape keeps their function, so the bundled drafters guess as well as they do on the bundled
target, while every matmul, GDN state and attention head is the 9B's size.

How (every map below keeps the small model's computation exact, up to the norms' eps and rounding):
- the residual stream is [x, 0]: embeddings and every weight that writes the stream are zero past
  the small hidden size; norms over the stream get weight * sqrt(d / D) (the RMS over D dims with
  D - d zeros is sqrt(d / D) of the small one's);
- the small layers are the wide model's first layers (the layer-type pattern is the same, an
  attention layer every 4th); the layers after them are identities (every weight that writes the
  stream is zero), so the hidden states the drafters tap are unchanged;
- heads keep their index (a query head moves to keep its K/V group); inside a head, the rotated dims
  move so that each rotated pair keeps its frequency (pair i of R rotated dims turns at
  base^(-2i/R): pair i of r dims goes to pair i * R / r), the others follow; padded dims inside a
  real head are zero, so q.k, the per-head norms and the L2 norms see the small head;
- attention's 1/sqrt(head_dim) and the per-head q/k norms' RMS over the wider head are folded into
  the q/k norm weights; GDN's Dk^-1/2 on q scales the output by sqrt(dk / Dk) before a per-head RMS
  norm over a value head that is dv / Dv real, so that norm's mean square is (dk / Dk)(dv / Dv) of
  the small one's. The bundled target's GDN outputs are so small (RMS ~3e-5 in layer 0) that the
  norm's eps dominates it, so the eps shrinks by the same factor (the config has one eps for all
  norms; the others see inputs of order 1, where the eps does not count);
- weights that read the stream or a head the small model lacks are random (extra heads, extra MLP
  units, the identity layers' input projections): they compute something real that a zero
  projection then drops, so no kernel sees an all-zero operand it might shortcut.
The vocabulary stays the bundled one (8192, tied): a 9B's 248k-row lm_head would be ~13 % of its
read, which the wide model does not pay. The DFlash drafter is widened to the z-lab 8B DFlash's
attention shape (32 heads, 8 K/V heads of 128) and the 9B's MLP, keeping its 2 layers. Written in
bf16 (the bundled weights' dtype), HF layout, one file per layer.

`--bits 4|8` writes every projection (not the embedding, norms or convolutions) quantized, affine,
groups of `--group-size`, with the `quantization` block mlx-community checkpoints carry: the shape a
9B is run in on a GPU (4.5 GB a step at 4 bits, where the engine's small-M kernel runs). A zero
group stays exactly zero (its scale and bias are 0), and every group that mixes real and padded
weights reads padded inputs that are exactly zero (real units, heads and the stream sit in whole
groups of 64), so what is lost is the real weights' rounding. At 4 bits (`test` shape, dev CPU) the
bundled prompt's 32 greedy tokens stayed the unquantized ones; MTP chains fell from 5.33 to 4.57
tokens per forward, DFlash chains stayed at 4.00.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from widen_maps import SHAPES, Dims, Plan  # noqa: E402

from engine.dtypes import DTYPES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "engine" / "bundled"
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
          "draft_vocab.safetensors")


# ---------------------------------------------------------------------------------------------
# Placing tensors


class Widener:
    """Builds wide tensors from small ones. `reads` weights (projections out of the stream or a
    head) start random where no real unit is; `writes` weights (into the stream) start zero."""

    def __init__(self, seed: int, dtype: mx.Dtype) -> None:
        self.key = mx.random.key(seed)
        self.dtype = dtype

    def random(self, shape: tuple[int, ...]) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return (mx.random.normal(shape, key=sub) * 0.02).astype(self.dtype)

    def matrix(self, small: mx.array | None, shape: tuple[int, int], rows: np.ndarray, cols: np.ndarray,
               real_rows: np.ndarray | None = None) -> mx.array:
        """A wide [out, in] weight: small [len(rows), len(cols)] placed at (rows, cols). real_rows
        given: a reads weight, random except the rows of real units (zero but for the placed
        block); None: a writes weight, zero but for the placed block."""
        if real_rows is None:
            return self.placed(mx.zeros(shape, dtype=self.dtype), small, rows, cols)
        wide = self.random(shape)
        if small is None:  # a layer the small model lacks: nothing real to keep clear
            return wide
        wide[mx.array(real_rows)] = mx.zeros((len(real_rows), shape[1]), dtype=self.dtype)
        return self.placed(wide, small, rows, cols)

    def placed(self, wide: mx.array, small: mx.array | None, rows: np.ndarray, cols: np.ndarray) -> mx.array:
        if small is not None:
            wide[mx.array(rows)[:, None], mx.array(cols)[None, :]] = small.astype(self.dtype)
        return wide

    def vector(self, small: mx.array | None, size: int, index: np.ndarray, scale: float = 1.0,
               fill: float = 0.0, shift: float = 0.0) -> mx.array:
        """A wide 1-D tensor: small (scaled) at `index`, `fill` elsewhere. shift: the norm is stored
        zero-centred (applied as shift + w), so the scale applies to shift + w."""
        wide = mx.full((size,), fill, dtype=mx.float32)
        if small is not None:
            wide[mx.array(index)] = (small.astype(mx.float32) + shift) * scale - shift
        return wide.astype(self.dtype)


def widen_norm(wd: Widener, w: mx.array | None, small: int, wide: int, zero_centred: bool,
               index: np.ndarray | None = None, extra: float = 1.0) -> mx.array:
    """An RMS norm over `small` dims moved into `wide` dims (the rest zero in its input): the RMS
    is sqrt(small / wide) of the small one's, so the weight is scaled by that (times `extra`).
    Elsewhere (padded dims, a layer the small model lacks) the norm applies 1."""
    index = np.arange(small) if index is None else index
    shift = 1.0 if zero_centred else 0.0
    return wd.vector(w, wide, index, math.sqrt(small / wide) * extra, fill=1.0 - shift, shift=shift)


def widen_attention(wd: Widener, p: Plan, t: dict[str, mx.array], pre: str, gated: bool,
                    zero_centred: bool) -> dict[str, mx.array]:
    """q/k/v/o projections and q/k norms of one attention layer (prefix `pre`, e.g. `...self_attn.`)."""
    s, w = p.small, p.wide
    hid = p.hidden
    get = t.get
    qr, q_real = p.q_rows(gated)
    kr, k_real = p.kv_rows()
    q_width = w.heads * w.head_dim * (2 if gated else 1)
    out = {
        pre + "q_proj.weight": wd.matrix(get(pre + "q_proj.weight"), (q_width, w.hidden), qr, hid, q_real),
        pre + "k_proj.weight": wd.matrix(get(pre + "k_proj.weight"), (w.kv_heads * w.head_dim, w.hidden), kr, hid,
                                         k_real),
        pre + "v_proj.weight": wd.matrix(get(pre + "v_proj.weight"), (w.kv_heads * w.head_dim, w.hidden), kr, hid,
                                         k_real),
        pre + "o_proj.weight": wd.matrix(get(pre + "o_proj.weight"), (w.hidden, w.heads * w.head_dim), hid,
                                         p.o_cols()),
    }
    # q.k is unchanged (padded dims zero); the norms' RMS over the wider head is sqrt(hs / hw) of the
    # small one's (widen_norm's factor), and the softmax scale hw^-1/2 against hs^-1/2 wants q
    # sqrt(hw / hs) larger: q's weight moves by both (1 in all), k's by the first only
    d = p.dim_map
    out[pre + "q_norm.weight"] = widen_norm(wd, get(pre + "q_norm.weight"), s.head_dim, w.head_dim, zero_centred,
                                            d, extra=math.sqrt(w.head_dim / s.head_dim))
    out[pre + "k_norm.weight"] = widen_norm(wd, get(pre + "k_norm.weight"), s.head_dim, w.head_dim, zero_centred, d)
    return out


def widen_mlp(wd: Widener, p: Plan, t: dict[str, mx.array], pre: str) -> dict[str, mx.array]:
    w, hid, units = p.wide, p.hidden, p.units
    get = t.get
    return {
        pre + "gate_proj.weight": wd.matrix(get(pre + "gate_proj.weight"), (w.intermediate, w.hidden), units, hid,
                                            units),
        pre + "up_proj.weight": wd.matrix(get(pre + "up_proj.weight"), (w.intermediate, w.hidden), units, hid, units),
        pre + "down_proj.weight": wd.matrix(get(pre + "down_proj.weight"), (w.hidden, w.intermediate), hid, units),
    }


def widen_gdn(wd: Widener, p: Plan, t: dict[str, mx.array], pre: str) -> dict[str, mx.array]:
    """One Gated DeltaNet mixer (prefix `...linear_attn.`). q is L2-normalised then scaled by Dk^-1/2:
    the wider Dk makes the output sqrt(dk / Dk) of the small one, which the per-head RMS norm after
    it removes (its eps shrinks with it: widen_target); that norm's RMS over the wider value head is
    folded into its weight."""
    s, w = p.small, p.wide
    get = t.get
    maps = p.gdn_maps()
    conv, conv_real = maps["conv"]
    val, val_real = maps["value"]
    heads = np.arange(s.v_heads)  # value head u stays head u (its key head u // ratio too)
    hid = p.hidden
    conv_dim = 2 * w.k_heads * w.k_dim + w.v_heads * w.v_dim
    small_conv = get(pre + "conv1d.weight")  # HF [C, 1, K]
    conv_w = wd.matrix(None if small_conv is None else small_conv.reshape(small_conv.shape[0], -1),
                       (conv_dim, s.conv_kernel), conv, np.arange(s.conv_kernel), conv_real)
    return {
        pre + "in_proj_qkv.weight": wd.matrix(get(pre + "in_proj_qkv.weight"), (conv_dim, w.hidden), conv, hid,
                                              conv_real),
        pre + "in_proj_z.weight": wd.matrix(get(pre + "in_proj_z.weight"), (w.v_heads * w.v_dim, w.hidden), val, hid,
                                            val_real),
        pre + "in_proj_b.weight": wd.matrix(get(pre + "in_proj_b.weight"), (w.v_heads, w.hidden), heads, hid, heads),
        pre + "in_proj_a.weight": wd.matrix(get(pre + "in_proj_a.weight"), (w.v_heads, w.hidden), heads, hid, heads),
        pre + "conv1d.weight": conv_w.reshape(conv_dim, 1, -1),
        pre + "A_log": wd.vector(get(pre + "A_log"), w.v_heads, heads),
        pre + "dt_bias": wd.vector(get(pre + "dt_bias"), w.v_heads, heads),
        pre + "norm.weight": wd.vector(get(pre + "norm.weight"), w.v_dim, np.arange(s.v_dim),
                                       math.sqrt(s.v_dim / w.v_dim), fill=1.0),
        pre + "out_proj.weight": wd.matrix(get(pre + "out_proj.weight"), (w.hidden, w.v_heads * w.v_dim), hid, val),
    }


def widen_layer(wd: Widener, p: Plan, t: dict[str, mx.array], pre: str, attention: bool, gated: bool,
                zero_centred: bool) -> dict[str, mx.array]:
    """A decoder layer (prefix `model.layers.N.` or similar); absent small tensors (a layer past the
    small model's) make an identity layer."""
    s, w = p.small, p.wide
    out = {pre + n: widen_norm(wd, t.get(pre + n), s.hidden, w.hidden, zero_centred)
           for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    if attention:
        out |= widen_attention(wd, p, t, pre + "self_attn.", gated, zero_centred)
    else:
        out |= widen_gdn(wd, p, t, pre + "linear_attn.")
    return out | widen_mlp(wd, p, t, pre + "mlp.")


# ---------------------------------------------------------------------------------------------
# Checkpoints


def load_small(path: Path) -> dict[str, mx.array]:
    tensors: dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        if f.name != "draft_vocab.safetensors":
            loaded = mx.load(str(f))
            assert isinstance(loaded, dict)
            tensors |= loaded
    return tensors


def widen_target(src: Path, out: Path, wide: Dims, dtype: mx.Dtype = mx.bfloat16, seed: int = 0,
                 quant: Quantization | None = None) -> dict:
    """The target checkpoint at `src` (HF layout, Qwen3.5 text, maybe with mtp.safetensors) widened
    into `out`, its projections quantized where `quant` says. -> the wide config."""
    cfg = json.loads((src / "config.json").read_text())
    cfg = dict(cfg, **cfg.get("text_config", {}))
    small = Dims.of_target(cfg)
    if replace(wide, rotary=small.rotary) != wide:
        raise ValueError("the wide target must turn the same share of each head as the small one")
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                       for i in range(small.layers)]
    every = types.index("full_attention") + 1
    wide_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(wide.layers)]
    if wide_types[: small.layers] != types:
        raise ValueError(f"layer types {types} are not a repeating pattern of every {every}")
    p, t, wd = Plan(small, wide), load_small(src), Widener(seed, dtype)
    out.mkdir(parents=True)
    e = t["model.embed_tokens.weight"]
    first = {"model.embed_tokens.weight": wd.matrix(e, (e.shape[0], wide.hidden), np.arange(e.shape[0]), p.hidden),
             "model.norm.weight": widen_norm(wd, t["model.norm.weight"], small.hidden, wide.hidden, True)}
    if "lm_head.weight" in t:
        first["lm_head.weight"] = wd.matrix(t["lm_head.weight"], (e.shape[0], wide.hidden), np.arange(e.shape[0]),
                                            p.hidden)
    _save(out / "model-00000.safetensors", first, quant)
    for i in range(wide.layers):
        pre = f"model.layers.{i}."
        layer = widen_layer(wd, p, t, pre, wide_types[i] == "full_attention", True, True)
        _save(out / f"model-{i + 1:05d}.safetensors", layer, quant)
    mtp = {k: v for k, v in t.items() if k.startswith("mtp.")}
    if mtp:
        head = {n: widen_norm(wd, mtp.get(n), small.hidden, wide.hidden, True)
                for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")}
        cols = np.concatenate([p.hidden, wide.hidden + p.hidden])  # [embedding | hidden], each padded
        head["mtp.fc.weight"] = wd.matrix(mtp["mtp.fc.weight"], (wide.hidden, 2 * wide.hidden), p.hidden, cols)
        n_layers = 1 + max(int(k.split(".")[2]) for k in mtp if k.startswith("mtp.layers."))
        for i in range(n_layers):
            head |= widen_layer(wd, p, mtp, f"mtp.layers.{i}.", True, True, True)
        _save(out / "mtp.safetensors", head, quant)
    wide_cfg = {k: v for k, v in cfg.items() if k != "text_config"}
    wide_cfg.update(hidden_size=wide.hidden, num_hidden_layers=wide.layers, intermediate_size=wide.intermediate,
                    num_attention_heads=wide.heads, num_key_value_heads=wide.kv_heads, head_dim=wide.head_dim,
                    linear_num_key_heads=wide.k_heads, linear_num_value_heads=wide.v_heads,
                    linear_key_head_dim=wide.k_dim, linear_value_head_dim=wide.v_dim, layer_types=wide_types,
                    rms_norm_eps=cfg["rms_norm_eps"] * small.k_dim / wide.k_dim * small.v_dim / wide.v_dim,
                    dtype=next(n for n, d in DTYPES.items() if d == dtype), widened_from=str(small))
    if quant is not None:
        wide_cfg["quantization"] = quant.block()
    (out / "config.json").write_text(json.dumps(wide_cfg, indent=1))
    for name in COPIED:  # token ids do not move
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return wide_cfg


def widen_dflash(src: Path, out: Path, wide: Dims, target_layers: int, dtype: mx.Dtype = mx.bfloat16,
                 seed: int = 1, quant: Quantization | None = None) -> dict:
    """The DFlash drafter at `src` widened into `out` for a target widened to `wide.hidden`: its fc
    reads the same tapped layers (the wide target's first layers are the small ones)."""
    cfg = json.loads((src / "config.json").read_text())
    small = Dims.of_dflash(cfg)
    if wide.layers != small.layers:
        raise ValueError("a widened DFlash drafter keeps its layer count")
    p, t, wd = Plan(small, wide), load_small(src), Widener(seed, dtype)
    taps = len((cfg.get("dflash_config") or cfg)["target_layer_ids"])
    cols = np.concatenate([j * wide.hidden + p.hidden for j in range(taps)])
    tensors = {"fc.weight": wd.matrix(t["fc.weight"], (wide.hidden, taps * wide.hidden), p.hidden, cols),
               "hidden_norm.weight": widen_norm(wd, t["hidden_norm.weight"], small.hidden, wide.hidden, False),
               "norm.weight": widen_norm(wd, t["norm.weight"], small.hidden, wide.hidden, False)}
    for i in range(small.layers):
        tensors |= widen_layer(wd, p, t, f"layers.{i}.", True, False, False)
    out.mkdir(parents=True)
    _save(out / "model.safetensors", tensors, quant)
    wide_cfg = dict(cfg, hidden_size=wide.hidden, intermediate_size=wide.intermediate, num_attention_heads=wide.heads,
                    num_key_value_heads=wide.kv_heads, head_dim=wide.head_dim, num_target_layers=target_layers,
                    widened_from=str(small))
    if quant is not None:
        wide_cfg["quantization"] = quant.block()
    (out / "config.json").write_text(json.dumps(wide_cfg, indent=1))
    return wide_cfg


@dataclass(frozen=True)
class Quantization:
    bits: int
    group_size: int = 64

    def block(self) -> dict:
        """The config's `quantization` block (engine/loader.py, mlx-lm)."""
        return {"group_size": self.group_size, "bits": self.bits}

    def apply(self, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
        """Every projection's [out, in] weight as packed weight, scales and biases (MLX's affine
        layout); the embedding, norms and 3-D convolution weights as they are."""
        out: dict[str, mx.array] = {}
        for name, w in tensors.items():
            if name.endswith(".weight") and w.ndim == 2 and "embed_tokens" not in name:
                stem = name[: -len(".weight")]
                out[name], out[f"{stem}.scales"], out[f"{stem}.biases"] = mx.quantize(
                    w, group_size=self.group_size, bits=self.bits)
            else:
                out[name] = w
        return out


def _save(path: Path, tensors: dict[str, mx.array], quant: Quantization | None = None) -> None:
    mx.eval(tensors)
    mx.save_safetensors(str(path), tensors if quant is None else quant.apply(tensors))


def widen(out: Path, shape: str, target: Path = BUNDLED / "target", dflash: Path | None = BUNDLED / "dflash",
          dtype: mx.Dtype = mx.bfloat16, quant: Quantization | None = None) -> tuple[Path, Path | None]:
    """-> (the wide target's directory, the wide DFlash drafter's or None)."""
    wide_target, wide_dflash = SHAPES[shape]
    widen_target(target, out / "target", wide_target, dtype, quant=quant)
    if dflash is None:
        return out / "target", None
    widen_dflash(dflash, out / "dflash", wide_dflash, wide_target.layers, dtype, quant=quant)
    return out / "target", out / "dflash"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="a directory that does not exist yet (target/ and dflash/ go in it)")
    ap.add_argument("--shape", choices=list(SHAPES), default="9b")
    ap.add_argument("--target", type=Path, default=BUNDLED / "target")
    ap.add_argument("--dflash", default=str(BUNDLED / "dflash"), help="'' for none")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=None, help="quantize the projections (affine)")
    ap.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64)
    a = ap.parse_args(argv)
    if a.out.exists():
        ap.error(f"{a.out} exists")
    quant = Quantization(a.bits, a.group_size) if a.bits else None
    target, dflash = widen(a.out, a.shape, a.target, Path(a.dflash) if a.dflash else None, DTYPES[a.dtype], quant)
    size = sum(f.stat().st_size for f in target.glob("*.safetensors"))
    print(f"wrote {target} ({size / 1e9:.2f} GB)" + (f" and {dflash}" if dflash else ""))


if __name__ == "__main__":
    main()
