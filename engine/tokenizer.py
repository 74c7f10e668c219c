"""A `tokenizers` wrapper for one checkpoint directory, and a UTF-8 safe incremental detokenizer.

No mlx here: the server uses this module on its own thread.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

REPLACEMENT = "\ufffd"
# End-of-turn / end-of-text tokens of the Qwen and ChatML families: generation stops on them
# even when a checkpoint's configs forget to list them.
EXTRA_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
# Below this many ids, decode() calls the tokenizer directly (the incremental detokenizer decodes a
# few ids per token); above it, through decode_batch, which releases the GIL while it works.
_LONG_DECODE = 256
# How much a normalizer may shrink UTF-8 text (NFC composes a Hangul syllable from 3 jamo: 9 bytes -> 3).
_NORMALIZER_SLACK = 4


class Tokenizer:
    """Text <-> token ids for one checkpoint. encode never adds BOS; special tokens in text are parsed
    unless asked not to (text a user typed must not become control tokens).

    encode and long decodes go through the `tokenizers` batch calls, which release the GIL: a
    megabyte of text takes about a second, and the server's event loop keeps running meanwhile.
    """

    def __init__(
        self,
        tok: HFTokenizer,
        config: dict | None = None,
        generation_config: dict | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tok = tok
        config = config or {}
        self.chat_template = chat_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = self._collect_eos_ids(generation_config or {})
        self.added_token_ids = tuple(sorted(tok.get_added_tokens_decoder()))  # chat, FIM and end markers
        added = tok.get_added_tokens_decoder().values()
        # longest first, so that a regex alternation prefers "<|im_end|>" over a shorter prefix
        self.special_tokens = tuple(sorted({a.content for a in added if a.special}, key=lambda t: (-len(t), t)))
        self.max_token_bytes = max(map(self._piece_bytes, tok.get_vocab(with_added_tokens=True)), default=1)
        self._bytes_per_token_bound = self.max_token_bytes * (1 if tok.normalizer is None else _NORMALIZER_SLACK)
        # encode_special_tokens (read special tokens as text) is a switch on the one tokenizer:
        # encodes hold this lock, so that no encode sees another's setting
        self._encode_lock = threading.Lock()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{path}: missing tokenizer.json (needed to tokenize text)")
        config = _read_json(path / "tokenizer_config.json")
        template = _read_template(path, config)
        return cls(HFTokenizer.from_file(str(tok_file)), config, _read_json(path / "generation_config.json"), template)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """special=False: special tokens spelled out in the text ("<|im_end|>") stay text."""
        return self.encode_many([text], special)[0]

    def encode_many(self, texts: list[str], special: bool = True) -> list[list[int]]:
        """encode() of several texts in one call."""
        if not texts:
            return []
        # tokenizers >= 0.21 has encode_batch_fast: no offsets, about 2x faster
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        with self._encode_lock:
            self._tok.encode_special_tokens = not special
            return [e.ids for e in batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special: bool = True) -> str:
        ids = list(ids)
        if len(ids) <= _LONG_DECODE:
            return self._tok.decode(ids, skip_special_tokens=skip_special)
        return self._tok.decode_batch([ids], skip_special_tokens=skip_special)[0]

    def max_text_bytes(self, tokens: int) -> int:
        """Text of more UTF-8 bytes than this has more than `tokens` tokens: no token stands for more
        than max_token_bytes of text (allowing for the normalizer). Lets the server refuse text that
        cannot fit the context before tokenizing it. Holds for byte-level BPE and SentencePiece
        vocabularies, whose tokens never drop text."""
        return tokens * self._bytes_per_token_bound

    def _piece_bytes(self, piece: str) -> int:
        """Bytes of text a vocabulary entry stands for (at most: a SentencePiece "▁" counts 3)."""
        if isinstance(self._tok.decoder, decoders.ByteLevel) and all(ch in _BYTE_DECODER for ch in piece):
            return len(piece)  # one character per byte
        return len(piece.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level BPE token may hold part of a UTF-8
        character); b"" for an id past the vocabulary (padded embedding rows)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self._tok.decoder, decoders.ByteLevel) and all(ch in _BYTE_DECODER for ch in piece):
            return bytes(_BYTE_DECODER[ch] for ch in piece)
        return self.decode([token_id], skip_special=False).encode("utf-8")

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def detokenizer(self, skip_special: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special)

    def _collect_eos_ids(self, generation_config: dict) -> tuple[int, ...]:
        ids: list[int | None] = []
        gen_eos = generation_config.get("eos_token_id")
        ids += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        for token in (self.eos_token, *EXTRA_EOS_TOKENS):
            ids.append(self.token_id(token) if token else None)
        return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas that never end inside a UTF-8 character.

    Decoding a token alone loses bytes (a CJK character or an emoji is often split across
    byte-level tokens), so each call decodes a short window: the tokens already emitted since
    the last boundary (as context) plus the new ones, and emits only what the new ones added.
    A trailing U+FFFD means the window ends inside a character: hold everything back until
    more bytes arrive (or flush).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # window start: first token of the last emitted span
        self._read = 0  # tokens before this index have been emitted as text

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, self._skip_special) if ids else ""


def _token_text(token) -> str | None:
    """tokenizer_config stores a token as a string or as a serialized AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _read_template(path: Path, config: dict) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json, as in HF transformers."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE spells each byte as one printable character; this undoes it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _byte_decoder()
