"""Tokenize the corpus into flat uint16 id arrays for training and evaluation.

Every example is followed by <|endoftext|> (the document separator; for FIM it also ends
the middle). Train examples are shuffled with --seed so that files, chat and FIM mix in
every batch; held-out examples are kept per kind so that each gets its own perplexity.
The token spans of the FIM middles (after <|fim_middle|>, through the <|endoftext|>) are
saved too, so that training can weight the few tokens that teach infilling.

    python scripts/encode_corpus.py CORPUS_DIR TOKENIZER_DIR [--seed 0]
writes CORPUS_DIR/train.npy, train_fim_spans.npy ((n, 2) [start, end) token indices)
and heldout_{file,chat,fim}.npy
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

KINDS = ("file", "chat", "fim")


def read_examples(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def encode(tok: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(uint16 ids of all texts, each followed by <|endoftext|>; (n, 2) spans of FIM middles)."""
    eot = tok.token_to_id("<|endoftext|>")
    middle = tok.token_to_id("<|fim_middle|>")
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        if middle in enc.ids:
            start = len(ids) + len(enc.ids) - enc.ids[::-1].index(middle)  # first token after it
            spans.append((start, len(ids) + len(enc.ids) + 1))  # the <|endoftext|> included
        ids.extend(enc.ids)
        ids.append(eot)
    arr = np.asarray(ids, dtype=np.int64)
    if arr.max() >= 2**16:
        raise ValueError("vocab does not fit uint16")
    return arr.astype(np.uint16), np.asarray(spans, dtype=np.int64).reshape(-1, 2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", type=Path)
    ap.add_argument("tokenizer", type=Path, help="checkpoint dir holding tokenizer.json")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    tok = Tokenizer.from_file(str(a.tokenizer / "tokenizer.json"))
    train = read_examples(a.corpus / "train.jsonl")
    random.Random(a.seed).shuffle(train)
    arr, spans = encode(tok, [ex["text"] for ex in train])
    np.save(a.corpus / "train.npy", arr)
    np.save(a.corpus / "train_fim_spans.npy", spans)
    chars = sum(len(ex["text"]) for ex in train)
    print(f"train: {len(train)} examples, {arr.size} tokens ({chars / arr.size:.2f} chars/token), "
          f"{int((spans[:, 1] - spans[:, 0]).sum())} FIM middle tokens")
    heldout = read_examples(a.corpus / "heldout.jsonl")
    for kind in KINDS:
        arr, _ = encode(tok, [ex["text"] for ex in heldout if ex["kind"] == kind])
        np.save(a.corpus / f"heldout_{kind}.npy", arr)
        print(f"heldout {kind}: {arr.size} tokens")


if __name__ == "__main__":
    main()
