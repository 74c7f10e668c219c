"""Training data for the bundled drafters: the bundled target's own continuations of the
training prompts, with the target's hidden states of every position.

Prompts come from the train split of the corpus (scripts/build_corpus.py): chat requests
rendered with the chat template up to the assistant turn (thinking off), code prefixes cut from
whole modules, and FIM prompts cut at `<|fim_middle|>`. The target continues each one, greedily
or sampled (temperature 0.8), in batches of prompts of one token length (so that no padding is
needed). Every position, prompt included, is fed one token at a time through HF transformers'
recurrent path, which on a CPU is several times faster than its chunked prefill, and the hidden
states are recorded on the way: the residual stream after every decoder layer and the
final-normed hidden state (what DFlash and MTP heads read).

    python scripts/drafter_data.py --corpus build/bundled_data --out build/drafter_data \
        [--chat 1536 --code 768 --fim 768 --new-tokens 192 --batch 256 --seed 0]

Writes OUT/tokens.npy (int32, all sequences back to back), OUT/features.npy (float16
[tokens, layers + 1, hidden]: after layer 0..L-1, then the final norm), OUT/sequences.json
(per sequence: start, prompt length, length, kind, greedy) and OUT/summary.json.
Deterministic for one --seed on one machine (sampling uses a seeded torch generator).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
ASSISTANT_START = "<|im_start|>assistant\n"
NO_THINK = "<think>\n\n</think>\n\n"  # the template's prefix of a reply with thinking off
STOP_IDS = (0, 2)  # <|endoftext|>, <|im_end|>


@dataclass(frozen=True)
class Prompt:
    kind: str  # chat | code | fim
    ids: tuple[int, ...]


@dataclass(frozen=True)
class SequenceInfo:
    start: int  # offset in tokens.npy
    prompt_len: int
    length: int
    kind: str
    greedy: bool


def chat_prompt(text: str) -> str | None:
    """A rendered chat example up to (and including) the opening of the assistant's reply."""
    cut = text.rfind(ASSISTANT_START)
    return None if cut < 0 else text[: cut + len(ASSISTANT_START)] + NO_THINK


def code_prompt(text: str, rng: random.Random) -> str | None:
    """A module's text up to the start of a random line (not the first ones)."""
    starts = [i + 1 for i, c in enumerate(text) if c == "\n"]
    if len(starts) < 10:
        return None
    cut = starts[rng.randrange(5, len(starts) - 2)]
    return text[max(0, cut - 1500) : cut]


def fim_prompt(text: str) -> str | None:
    marker = "<|fim_middle|>"
    cut = text.find(marker)
    return None if cut < 0 else text[: cut + len(marker)]


def read_prompts(corpus: Path, tok: Tokenizer, counts: dict[str, int], max_len: int, seed: int) -> list[Prompt]:
    """Prompts of every kind, code prompts cut to a token length shared by whole batches later."""
    rng = random.Random(seed)
    by_kind: dict[str, list[str]] = {"chat": [], "code": [], "fim": []}
    with (corpus / "train.jsonl").open(encoding="utf-8") as f:
        for line in f:
            ex = json.loads(line)
            text = {"chat": chat_prompt, "fim": fim_prompt}.get(ex["kind"], lambda t: code_prompt(t, rng))(ex["text"])
            kind = "code" if ex["kind"] == "file" else ex["kind"]
            if text:
                by_kind[kind].append(text)
    prompts = []
    for kind, n in counts.items():
        texts = rng.sample(by_kind[kind], min(n * 2, len(by_kind[kind])))
        kept = 0
        for text in texts:
            ids = tok.encode(text).ids
            if kind != "chat":  # code and FIM keep their last max_len tokens: left context is cut anyway
                ids = ids[-max_len:]
            if 8 <= len(ids) <= max_len:
                prompts.append(Prompt(kind, tuple(ids)))
                kept += 1
            if kept == n:
                break
    return prompts


def batches_of_equal_length(prompts: list[Prompt], batch: int, rng: random.Random) -> list[list[Prompt]]:
    """Group prompts by token length; a short group borrows nothing (small batches are only slower)."""
    groups: dict[int, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(len(p.ids), []).append(p)
    out = []
    for length in sorted(groups):
        group = groups[length]
        rng.shuffle(group)
        out += [group[i : i + batch] for i in range(0, len(group), batch)]
    return out


class HiddenRecorder:
    """Forward hooks that keep the last output of every decoder layer and of the final norm."""

    def __init__(self, model) -> None:
        self.outputs: list[torch.Tensor | None] = [None] * (len(model.model.layers) + 1)
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(self._hook(i))
        model.model.norm.register_forward_hook(self._hook(len(model.model.layers)))

    def _hook(self, i: int):
        def keep(_module, _inputs, output):
            self.outputs[i] = output[0] if isinstance(output, tuple) else output

        return keep

    def stacked(self) -> torch.Tensor:
        """[B, layers + 1, H] of the last fed position."""
        return torch.stack([o[:, -1] for o in self.outputs], dim=1)


@torch.no_grad()
def continue_batch(model, recorder: HiddenRecorder, ids: torch.Tensor, new_tokens: int, greedy: bool,
                   gen: torch.Generator, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed the prompts and then the continuation one token at a time.
    -> (tokens [B, P + new], features [B, P + new, layers + 1, H]) (the last token's features are
    those of feeding it)."""
    B, P = ids.shape
    tokens = torch.empty(B, P + new_tokens, dtype=torch.long)
    tokens[:, :P] = ids
    feats = []
    cache = None
    stopped = torch.zeros(B, dtype=torch.bool)
    end = P + new_tokens
    for t in range(P + new_tokens - 1):
        out = model(input_ids=tokens[:, t : t + 1].to(model.device), cache=cache, use_cache=True)
        cache = out.past_key_values
        feats.append(recorder.stacked().to("cpu", torch.float16))
        if t + 1 >= P:
            logits = out.logits[:, -1].float()
            if greedy:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, -1).cpu()
                nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
            tokens[:, t + 1] = nxt.cpu()
            stopped |= torch.isin(tokens[:, t + 1], torch.tensor(STOP_IDS))
            if bool(stopped.all()):  # what follows a stop token is never trained on
                end = t + 2
                break
    out = model(input_ids=tokens[:, end - 1 : end].to(model.device), cache=cache, use_cache=True)
    feats.append(recorder.stacked().to("cpu", torch.float16))
    return tokens[:, :end], torch.stack(feats, dim=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--target", type=Path, default=ROOT / "engine" / "bundled" / "target")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--chat", type=int, default=1536)
    ap.add_argument("--code", type=int, default=768)
    ap.add_argument("--fim", type=int, default=768)
    ap.add_argument("--max-prompt", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sampled-share", type=float, default=0.3, help="share of batches sampled, not greedy")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = Tokenizer.from_file(str(a.target / "tokenizer.json"))
    model = tf.AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).to(device).eval()
    recorder = HiddenRecorder(model)
    rng = random.Random(a.seed)
    prompts = read_prompts(a.corpus, tok, {"chat": a.chat, "code": a.code, "fim": a.fim}, a.max_prompt, a.seed)
    # code and FIM prompts were cut to max_prompt tokens, so they batch together; chat groups by length
    batches = batches_of_equal_length(prompts, a.batch, rng)
    gen = torch.Generator().manual_seed(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    total = sum(len(b[0].ids) + a.new_tokens for b in batches for _ in b)  # an upper bound: rows may stop early
    slots, hidden = len(model.model.layers) + 1, model.config.hidden_size
    # written in place as batches finish: the features do not fit in memory twice
    tokens_out = np.lib.format.open_memmap(a.out / "tokens.npy", "w+", np.int32, (total,))
    feats_out = np.lib.format.open_memmap(a.out / "features.npy", "w+", np.float16, (total, slots, hidden))
    infos, start = [], 0
    t0 = time.perf_counter()
    for i, group in enumerate(batches):
        greedy = rng.random() >= a.sampled_share
        ids = torch.tensor([p.ids for p in group], dtype=torch.long)
        tokens, feats = continue_batch(model, recorder, ids, a.new_tokens, greedy, gen, a.temperature)
        n = tokens.shape[1]
        for row, p in enumerate(group):
            tokens_out[start : start + n] = tokens[row].numpy()
            feats_out[start : start + n] = feats[row].numpy()
            infos.append(SequenceInfo(start, len(p.ids), n, p.kind, greedy))
            start += n
        print(json.dumps({"batch": i + 1, "of": len(batches), "rows": len(group), "prompt_len": ids.shape[1],
                          "greedy": greedy, "tokens": start, "elapsed": round(time.perf_counter() - t0, 1)}),
              flush=True)
    tokens_out.flush()
    feats_out.flush()
    del tokens_out, feats_out
    (a.out / "used_tokens.txt").write_text(str(start))  # the arrays' rows past this are unused
    (a.out / "sequences.json").write_text(json.dumps([asdict(s) for s in infos]))
    summary = {"sequences": len(infos), "tokens": start,
               "generated_tokens": sum(s.length - s.prompt_len for s in infos),
               "kinds": {k: sum(s.kind == k for s in infos) for k in ("chat", "code", "fim")},
               "greedy_sequences": sum(s.greedy for s in infos), "seconds": round(time.perf_counter() - t0, 1),
               "args": {k: str(v) for k, v in vars(a).items()}}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
