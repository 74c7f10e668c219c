"""Rank a checkpoint's vocabulary by how often its tokens occur in a corpus, for the drafters'
reduced output vocabulary (engine/drafters/draft_vocab.py; FR-Spec's idea: a drafter that proposes
only frequent tokens needs only their rows of the lm_head).

Writes CHECKPOINT/draft_vocab.safetensors: `ranked_ids` int32 [V], every token id once, the most
frequent first (ties by id), the tokenizer's added tokens (chat markers, end of text, FIM) ranked
first whatever their count; metadata `default_size`, the size the engine uses unless told
otherwise. Prints the share of the corpus's and the held-out text's tokens the first N cover.

    python scripts/build_corpus.py build/bundled_data
    python scripts/draft_vocab.py --corpus build/bundled_data --checkpoint engine/bundled/target --default-size 1024

Without a corpus in the model's own domain, `--order id` ranks by token id (added tokens first):
a byte-level BPE vocabulary numbers its merges in the order its training learnt them, most frequent
pairs first, so low ids are roughly the frequent ones. A corpus given with it is only counted for
the coverage report (the bundled tokenizer on its own corpus: see the target's card).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from engine.tokenizer import Tokenizer

SIZES = (256, 512, 1024, 2048, 4096)


def texts(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def counts(tok: Tokenizer, path: Path, vocab: int) -> np.ndarray:
    total = np.zeros(vocab, dtype=np.int64)
    docs = texts(path)
    for i in range(0, len(docs), 512):
        for ids in tok.encode_many(docs[i : i + 512]):
            total += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab)[:vocab]
    return total


def rank(count: np.ndarray, first: list[int]) -> np.ndarray:
    """Every id once: `first` in its order, then the rest by count (descending), ties by id."""
    rest = np.setdiff1d(np.arange(count.size), np.asarray(first, dtype=np.int64))
    rest = rest[np.lexsort((rest, -count[rest]))]
    return np.concatenate([np.asarray(first, dtype=np.int64), rest]).astype(np.int32)


def coverage(ranked: np.ndarray, count: np.ndarray, size: int) -> float:
    return float(count[ranked[:size]].sum() / max(1, count.sum()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", help="a build_corpus.py output directory (train.jsonl, heldout.jsonl)")
    p.add_argument("--order", choices=("count", "id"), default="count",
                   help="count: by frequency in the corpus; id: by token id (no corpus needed)")
    p.add_argument("--checkpoint", required=True, help="the checkpoint directory (its tokenizer; the file goes there)")
    p.add_argument("--default-size", type=int, required=True, help="the draft vocabulary's default size")
    args = p.parse_args(argv)
    if args.order == "count" and not args.corpus:
        raise SystemExit("--order count needs --corpus")
    tok = Tokenizer.from_dir(args.checkpoint)
    corpus = Path(args.corpus) if args.corpus else None
    train = counts(tok, corpus / "train.jsonl", tok.vocab_size) if corpus else np.zeros(tok.vocab_size, np.int64)
    # chat and FIM markers first: few, and they end answers
    # --order id: a "count" that falls with the id ranks by id
    ranked = rank(train if args.order == "count" else -np.arange(tok.vocab_size), list(tok.added_token_ids))
    heldout = counts(tok, corpus / "heldout.jsonl", tok.vocab_size) \
        if corpus and (corpus / "heldout.jsonl").exists() else None
    for size in SIZES if corpus else ():
        line = f"first {size:5d}: {coverage(ranked, train, size):.4f} of the training text's tokens"
        if heldout is not None:
            line += f", {coverage(ranked, heldout, size):.4f} of the held-out text's"
        print(line)
    if not 0 < args.default_size <= ranked.size:
        raise SystemExit(f"--default-size must be in 1..{ranked.size}, got {args.default_size}")
    out = Path(args.checkpoint) / "draft_vocab.safetensors"
    save_file({"ranked_ids": ranked}, str(out), metadata={"default_size": str(args.default_size), "order": args.order,
                                                          "tokens_counted": str(int(train.sum()))})
    print(f"wrote {out} ({ranked.size} ids, default size {args.default_size})")


if __name__ == "__main__":
    main()
