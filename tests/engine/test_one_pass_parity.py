"""The one-pass drafters' networks (MTP head, DFlash, Weaver) match the PyTorch versions in
scripts/draft_heads.py (the MTP layer there is transformers' own Qwen3.5 decoder layer), loaded
from checkpoints in the published layouts.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

import engine.models.dflash as dflash_model
from engine import cpu_ext
from engine.loader import load_dflash, load_model, load_mtp, load_weaver
from tests.helpers import checkpoint_maker, parity_module


def heads():
    import sys

    sys.path.insert(0, str(checkpoint_maker().HERE))
    import draft_heads

    return draft_heads


def test_dflash_matches_pytorch(tiny_dflash, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    dh = heads()
    cfg = json.loads((tiny_dflash / "config.json").read_text())
    shape = dh.DFlashShape(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=4, kv_heads=2,
                           head_dim=16, intermediate=cfg["intermediate_size"],
                           target_layer_ids=tuple(cfg["dflash_config"]["target_layer_ids"]))
    ref = dh.DFlash(shape)
    ref.load_state_dict(load_file(tiny_dflash / "model.safetensors"))
    # the same checkpoint with the DFlash keys at the top level (as some third-party ones are)
    flat = tmp_path / "flat"
    shutil.copytree(tiny_dflash, flat)
    top = {k: v for k, v in cfg.items() if k != "dflash_config"} | cfg["dflash_config"]
    (flat / "config.json").write_text(json.dumps(top))
    rng = np.random.default_rng(0)
    T, L, H = 19, 16, cfg["hidden_size"]
    feats = rng.standard_normal((T, 2 * H)).astype(np.float32)
    block = rng.standard_normal((1, L, H)).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.tensor(block), torch.tensor(feats[None]), torch.arange(T, T + L)[None],
                   torch.arange(T)[None], torch.ones(1, 1, L, T + L, dtype=torch.bool)).numpy()
    for path in (tiny_dflash, flat):
        model = load_dflash(path)
        assert model.config.target_layer_ids == (1, 2) and model.config.mask_token_id == 13
        cache = model.make_cache()
        model.append_context(mx.array(feats[:7]), cache)  # the context grows in pieces, as rounds commit
        model.append_context(mx.array(feats[7:]), cache)
        # the CPU's attention operation (where built), the split form in MLX's operations, and the
        # fused kernel over the concatenation: the switches are read when the block is traced
        for one_op, split in ((True, True), (False, True), (False, False)):
            monkeypatch.setattr(cpu_ext, "ATTENTION", one_op)
            monkeypatch.setattr(dflash_model, "SPLIT_ON_CPU", split)
            np.testing.assert_allclose(np.array(model.block(mx.array(block), cache)), want, atol=2e-5)
        monkeypatch.undo()


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("where", ["file", "inline"])
def test_mtp_head_matches_pytorch(tiny_qwen35, tmp_path, where, fuse):
    torch = parity_module("torch")
    tf = parity_module("transformers")
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen35, ckpt)
    checkpoint_maker().add_mtp_to(ckpt, 21, where)
    target = load_model(ckpt).model
    head = load_mtp(ckpt, target.args, fuse=fuse)
    assert ("fused" in head.layers[0].self_attn and "fused" in head.layers[0].mlp) == fuse
    file = ckpt / ("mtp.safetensors" if where == "file" else "model.safetensors")
    ref = heads().MTP(tf.AutoConfig.from_pretrained(ckpt))
    ref.load_state_dict({k[4:]: v for k, v in load_file(file).items() if k.startswith("mtp.")}, strict=False)
    rng = np.random.default_rng(1)
    e, h = (rng.standard_normal((1, 9, 64)).astype(np.float32) for _ in range(2))
    with torch.no_grad():
        want = ref.eval()(torch.tensor(e), torch.tensor(h), torch.arange(9)[None]).numpy()
    cache = head.make_cache()
    got = [np.array(head(mx.array(e[:, :5]), mx.array(h[:, :5]), cache))]  # a chain, then single steps
    got += [np.array(head(mx.array(e[:, i : i + 1]), mx.array(h[:, i : i + 1]), cache)) for i in range(5, 9)]
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=2e-5)


@pytest.mark.parametrize("passes", [1, 3])
def test_mtp_training_unrolls_recursive_drafting(tiny_qwen35, tmp_path, passes):
    """scripts/train_drafters.py trains the head on K recursive depths in one batched forward a
    depth (draft_heads.MTP.unrolled). Every row's depth-k output there is what drafting through the
    head's cache gives: the head run causally over the committed rows 0..i, then over the draft's
    own depths, each fed the embedding of its token and the output of the depth before (as the
    engine drafts, twin above)."""
    torch = parity_module("torch")
    tf = parity_module("transformers")
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen35, ckpt)
    checkpoint_maker().add_mtp_to(ckpt, 23, "file")
    dh = heads()
    head = dh.MTP(tf.AutoConfig.from_pretrained(ckpt)).eval()
    head.load_state_dict({k[4:]: v for k, v in load_file(ckpt / "mtp.safetensors").items()}, strict=False)
    g = torch.Generator().manual_seed(passes)
    B, T, V, H = 2, 9, 40, 64
    embed = torch.randn(V, H, generator=g)
    toks = torch.randint(0, V, (B, T), generator=g)
    hidden = torch.randn(B, T, H, generator=g)
    with torch.no_grad():
        outs = head.unrolled(embed, toks, hidden, passes)
        assert [o.shape[1] for o in outs] == [T - 1 - k for k in range(1, passes + 1)]
        for k, out in enumerate(outs, 1):
            for i in range(out.shape[1]):
                e, h = embed[toks[:, 1 : i + 2]], hidden[:, : i + 1]  # the committed rows 0..i
                y = head(e, h, torch.arange(i + 1)[None].expand(B, -1))[:, -1:]
                for j in range(2, k + 1):  # depth j: x_{i+j} with depth j-1's output, one position on
                    e, h = torch.cat([e, embed[toks[:, i + j : i + j + 1]]], 1), torch.cat([h, y], 1)
                    y = head(e, h, torch.arange(e.shape[1])[None].expand(B, -1))[:, -1:]
                np.testing.assert_allclose(out[:, i].numpy(), y[:, 0].numpy(), atol=2e-5)


def test_weaver_matches_pytorch(tiny_dflash):
    import torch

    dh = heads()
    payload = torch.load(tiny_dflash / "weaver" / "weaver.pth", weights_only=True)
    ref = dh.Weaver(dh.WeaverShape(**{k: v for k, v in payload["config"].items()
                                      if k in dh.WeaverShape.__dataclass_fields__}))
    ref.load_state_dict(payload["state_dict"])
    weaver = load_weaver(tiny_dflash / "weaver")
    rng = np.random.default_rng(4)
    D, N, H = 5, 4, 64
    h_target, hidden = rng.standard_normal(H).astype(np.float32), rng.standard_normal((D, H)).astype(np.float32)
    path = rng.standard_normal((N, H)).astype(np.float32)  # the path's token embeddings, root first
    with torch.no_grad():
        want = ref.path_queries(torch.tensor(h_target[None]), torch.tensor(hidden[None]),
                                torch.tensor(path[None]))[0].numpy()
    prompt = weaver.prompt_kv(mx.array(h_target), mx.array(hidden))
    nodes, got = None, []
    for d in range(N):  # one node per call, each seeing all earlier ones (its ancestors)
        x = weaver.token_in(weaver.embed_norm(mx.array(path[d : d + 1])))
        q, new = weaver.step(x, mx.array([d]), prompt, nodes, mx.ones((1, d), dtype=mx.bool_))
        nodes = new if nodes is None else [(mx.concatenate([a, c], 1), mx.concatenate([b, e], 1))
                                           for (a, b), (c, e) in zip(nodes, new)]
        got.append(np.array(q)[0])
    np.testing.assert_allclose(np.stack(got), want, atol=2e-5)
