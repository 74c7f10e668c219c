"""Train the bundled model's byte-level BPE tokenizer on the training split of the corpus.

Writes tokenizer.json + tokenizer_config.json (chat template included) into every given
checkpoint dir, so the target and its draft share one vocabulary.

    python scripts/train_tokenizer.py CORPUS_DIR OUT_DIR [OUT_DIR ...] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from make_tiny_checkpoint import HERE, SPECIAL_TOKENS, train_tokenizer, write_tokenizer


def write_training_text(corpus: Path, tmp: Path, shard_chars: int = 4_000_000) -> list[Path]:
    """Plain-text shards of the train split, with special-token strings blanked out.

    The BPE trainer does not split added tokens out of its input, so "<|im_start|>" would
    otherwise spend merges on "<|", "im", "_start" that the tokenizer never produces.
    """
    shards: list[Path] = []
    buf: list[str] = []
    size = 0

    def flush() -> None:
        path = tmp / f"shard{len(shards):03d}.txt"
        path.write_text("".join(buf), encoding="utf-8")
        shards.append(path)
        buf.clear()

    for line in (corpus / "train.jsonl").open(encoding="utf-8"):
        text = json.loads(line)["text"]
        for token in SPECIAL_TOKENS:
            text = text.replace(token, "\n")
        buf.append(text + "\n")
        size += len(text)
        if size >= shard_chars:
            flush()
            size = 0
    if buf:
        flush()
    return shards


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", type=Path, help="dir with train.jsonl from build_corpus.py")
    ap.add_argument("out", type=Path, nargs="+", help="checkpoint dirs to write the tokenizer into")
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer(a.vocab, write_training_text(a.corpus, Path(tmp)))
    if tok.get_vocab_size() != a.vocab:
        sys.exit(f"trained {tok.get_vocab_size()} tokens, expected {a.vocab}")
    template = (HERE / "qwen35_chat_template.jinja").read_text()
    for out in a.out:
        out.mkdir(parents=True, exist_ok=True)
        write_tokenizer(out, tok, template)
        print(f"wrote tokenizer ({tok.get_vocab_size()} tokens) to {out}")


if __name__ == "__main__":
    main()
