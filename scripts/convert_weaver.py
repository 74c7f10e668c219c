"""Convert a Weaver adapter checkpoint (the published `.pth`: a torch pickle holding `config` and
`state_dict`) into what Spruce loads: OUT_DIR/config.json and OUT_DIR/model.safetensors.

    python scripts/convert_weaver.py weaver.pth OUT_DIR [--dtype bfloat16] [--trust-pickle]

Tensors keep their names (output_norm, embed_norm, token_in, proposal_in, blocks.N.*, out_norm,
lm_head_query_in). The file is first read with torch.load(weights_only=True), which refuses
anything but tensors and plain containers; a checkpoint whose config is a custom class needs
--trust-pickle (a pickle can run code: only for files you trust). Put the result in the DFlash
drafter's directory as `weaver/` to have it picked up by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

REQUIRED = ("d_model", "d_embed", "d_rank", "num_layers", "num_heads", "mlp_dim", "K", "candidate_pool_size")


def plain_config(config: Any) -> dict:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    elif not isinstance(config, dict):
        config = dict(vars(config))
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise SystemExit(f"the checkpoint's config lacks {missing} (has {sorted(config)})")
    return {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool, type(None), list))}


def read(path: Path, trust_pickle: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a custom class in the pickle
        if not trust_pickle:
            raise SystemExit(f"{path} is not a plain-tensor checkpoint ({e}); rerun with --trust-pickle if you "
                             "trust the file") from None
        payload = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or "state_dict" not in payload or "config" not in payload:
        raise SystemExit(f"{path}: expected a dict with 'config' and 'state_dict'")
    state = {k.removeprefix("module."): v for k, v in payload["state_dict"].items() if isinstance(v, torch.Tensor)}
    return plain_config(payload["config"]), state


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pth", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--trust-pickle", action="store_true")
    a = ap.parse_args(argv)
    from safetensors.torch import save_file

    config, state = read(a.pth, a.trust_pickle)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "config.json").write_text(json.dumps(config, indent=1))
    dtype = getattr(torch, a.dtype)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, a.out / "model.safetensors",
              metadata={"format": "pt"})
    print(f"wrote {len(state)} tensors and config.json to {a.out}")


if __name__ == "__main__":
    main()
