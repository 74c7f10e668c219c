"""The bundled default model (engine/bundled/): files, tokenizer, chat template, and that
transformers and Spruce's loader read the same network from it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.loader import load_model
from tests.helpers import hf_logits, parity_module

BUNDLED = Path(__file__).resolve().parents[2] / "engine" / "bundled"
TARGET, DRAFT, DFLASH = BUNDLED / "target", BUNDLED / "draft", BUNDLED / "dflash"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "generation_config.json")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
           "<|fim_suffix|>", "<|fim_pad|>", "<|MASK|>"]
TEXT_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CODE = 'def greet(name: str) -> str:\n    """Say hello — in Unicode: ünïcödé ✓."""\n\treturn f"hi {name}"\n'


@pytest.fixture(scope="module")
def hf_tokenizer():
    AutoTokenizer = parity_module("transformers").AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.mark.parametrize("path,attention_layers", [(TARGET, [3, 7]), (DRAFT, [1])], ids=["target", "draft"])
def test_checkpoint_files(path, attention_layers):
    for name in CHECKPOINT_FILES:
        assert (path / name).is_file(), f"{path.name}/{name} missing"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["vocab_size"] == 8192
    assert cfg["tie_word_embeddings"] and cfg["dtype"] == "bfloat16"
    # GDN and attention 3:1 in the target (1:1 in the draft): layer i is attention iff (i+1) % k == 0
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == attention_layers


def test_package_data_fits_budget_and_shares_tokenizer():
    total = sum(f.stat().st_size for f in BUNDLED.rglob("*") if f.is_file())
    assert total <= 64e6, f"bundled package data is {total / 1e6:.1f} MB, over 64 MB"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (TARGET / name).read_bytes() == (DRAFT / name).read_bytes()
    assert (TARGET / "README.md").is_file() and (TARGET / "loss.png").is_file()


def test_tokenizer_round_trip(hf_tokenizer):
    ids = hf_tokenizer.encode(CODE, add_special_tokens=False)
    assert hf_tokenizer.decode(ids) == CODE
    ascii_code = "    def __init__(self, name):\n        self.name = name\n        return None\n"
    assert len(hf_tokenizer.encode(ascii_code)) < len(ascii_code) / 3  # trained merges, not bytes
    for token in SPECIAL + TEXT_TAGS:
        assert len(hf_tokenizer.encode(token, add_special_tokens=False)) == 1, token
    # <think> and friends are ordinary text: they survive skip_special_tokens, im markers do not.
    ids = hf_tokenizer.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\nok<|im_end|>",
                              add_special_tokens=False)
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\nok"
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.pad_token == "<|endoftext|>"


def test_chat_template_renders(hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    off = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False)
    assert off == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = hf_tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True)
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize("path", [TARGET, DRAFT], ids=["target", "draft"])
def test_spruce_loader_matches_transformers(path, hf_tokenizer):
    ids = hf_tokenizer.encode(CODE, add_special_tokens=False)
    ref = hf_logits(path, ids)
    model = load_model(path).model
    ours = np.array(model(mx.array([ids]), model.make_cache())[0])
    assert np.abs(ours - ref).max() <= 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_target_answers_a_code_request_with_code(hf_tokenizer):
    """A check that the trained weights shipped, not random ones: the answer opens a code block."""
    torch = parity_module("torch")
    AutoModelForCausalLM = parity_module("transformers").AutoModelForCausalLM

    prompt = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a python function to merge two sorted lists"}],
        tokenize=False, add_generation_prompt=True, enable_thinking=False)
    ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert hf_tokenizer.decode(out[0, ids.shape[1]:]).startswith("```python\ndef ")


def test_bundled_drafters_are_there_with_cards():
    assert (TARGET / "mtp.safetensors").is_file()  # the MTP head, as quantized repos ship it
    for name in ("config.json", "model.safetensors", "README.md", "weaver/config.json", "weaver/model.safetensors"):
        assert (DFLASH / name).is_file(), f"dflash/{name} missing"
    assert not list(BUNDLED.rglob("*.pth"))  # pickles stay out of the package


# floors under what the shipped heads reach on this prompt (MTP 4.3, DFlash 3.3 chain / 3.9 ddtree,
# Weaver 3.6 at 48 tokens): a broken feature tap or an untrained head falls to about 1
@pytest.mark.parametrize("method,tree,floor", [("mtp", "chain", 2.5), ("mtp", "ddtree", 2.5),
                                               ("dflash", "chain", 2.5), ("dflash", "ddtree", 2.8),
                                               ("dflash", "weaver", 2.5)])
def test_bundled_drafters_draft_what_the_target_says(hf_tokenizer, method, tree, floor):
    """Trained, not random, drafters: on a code request most rounds accept drafts, and the output is
    plain decoding's."""
    from engine.config import SamplingParams, SpecConfig
    from tests.helpers import generate

    engine = bundled_engine()
    prompt = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a python function to return the number of lines in a text file"}],
        tokenize=False, add_generation_prompt=True, enable_thinking=False)
    ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    sampling = SamplingParams(max_tokens=48)
    plain = generate(engine, ids, sampling).tokens
    out = generate(engine, ids, sampling, SpecConfig(method=method, tree=tree, budget=16, max_depth=8,
                                                     adaptive=False))
    assert out.tokens == plain
    assert out.stats.tokens_per_forward >= floor, out.stats


@functools.cache
def bundled_engine():
    from engine.config import EngineConfig
    from engine.generate import Engine

    return Engine(EngineConfig(model_path=str(TARGET)))
