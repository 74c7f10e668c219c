"""Training data for the bundled drafters: the bundled target's own continuations of the
training prompts, with the target's hidden states of every position.

Prompts come from the train split of the corpus (scripts/build_corpus.py): chat requests
rendered with the chat template up to the assistant turn (thinking off), code prefixes cut from
whole modules, and FIM prompts cut at `<|fim_middle|>`. The target continues each one, greedily
or sampled (plain temperature 0.8), with HF transformers' generate in batches of prompts of
similar length (left-padded with an attention mask), through its first stop token. Then one
teacher-forced forward over each batch (right-padded, so no position sees padding) records the
hidden states of every position: the residual stream after every decoder layer and the
final-normed hidden state (what DFlash and MTP heads read).

    python scripts/drafter_data.py --corpus build/bundled_data --out build/drafter_data \
        [--chat 1536 --code 768 --fim 768 --new-tokens 192 --batch 256 --seed 0]

The prompts depend on the interpreter's stdlib (the corpus). To run the generation on another
machine (the GPU one, whose Python differs), pick them here with --save-prompts FILE and hand
that file over with --prompts FILE instead of --corpus.

Writes OUT/tokens.npy (int32, all sequences back to back), OUT/features.npy (float16
[tokens, layers + 1, hidden]: after layer 0..L-1, then the final norm), OUT/sequences.json
(per sequence: start, prompt length, length, kind, greedy) and OUT/summary.json.
Deterministic for one --seed on one machine (each batch seeds torch's generator).
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


def batches_by_length(prompts: list[Prompt], batch: int, rng: random.Random) -> list[list[Prompt]]:
    """Prompts sorted by token length and cut into batches (little left padding), in random order."""
    ordered = sorted(prompts, key=lambda p: len(p.ids))
    out = [ordered[i : i + batch] for i in range(0, len(ordered), batch)]
    rng.shuffle(out)
    return out


class HiddenRecorder:
    """Forward hooks that keep the output of every decoder layer and of the final norm."""

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
        """[B, T, layers + 1, H] of the last forward."""
        return torch.stack(self.outputs, dim=2)


def sampling_config(greedy: bool, new_tokens: int, temperature: float) -> tf.GenerationConfig:
    """Plain greedy or plain temperature sampling. It replaces the checkpoint's generation_config
    (whose top-k, top-p and repetition penalty would otherwise be merged in)."""
    return tf.GenerationConfig(do_sample=not greedy, temperature=temperature if not greedy else 1.0, top_k=0,
                               top_p=1.0, min_p=None, repetition_penalty=1.0, max_new_tokens=new_tokens,
                               eos_token_id=list(STOP_IDS), pad_token_id=0)


@torch.no_grad()
def continue_batch(model, recorder: HiddenRecorder, prompts: list[tuple[int, ...]], new_tokens: int, greedy: bool,
                   seed: int, temperature: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """Continue the prompts (left-padded, with HF's attention mask) and record the hidden states of
    every position of each prompt + continuation (through its first stop token) with one
    teacher-forced forward (right-padded: causal layers do not see what follows a position).
    -> per row (tokens [T], features [T, layers + 1, H] fp16)."""
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p) :] = torch.tensor(p)
        mask[r, P - len(p) :] = 1
    torch.manual_seed(seed)  # generate samples with the global generator
    model.generation_config = sampling_config(greedy, new_tokens, temperature)
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).cpu()
    rows = []
    for r, p in enumerate(prompts):
        cont = out[r, P:].tolist()
        stop = next((i for i, t in enumerate(cont) if t in STOP_IDS), len(cont) - 1)
        rows.append(list(p) + cont[: stop + 1])
    T = max(len(r) for r in rows)
    full = torch.zeros(B, T, dtype=torch.long)
    for r, row in enumerate(rows):
        full[r, : len(row)] = torch.tensor(row)
    model(input_ids=full.to(model.device), use_cache=False)
    feats = recorder.stacked().to("cpu", torch.float16)
    return [(np.array(row, dtype=np.int32), feats[r, : len(row)].numpy()) for r, row in enumerate(rows)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", type=Path, help="the bundled model's corpus (scripts/build_corpus.py)")
    src.add_argument("--prompts", type=Path, help="prompts saved by an earlier --save-prompts")
    ap.add_argument("--save-prompts", type=Path, help="write the chosen prompts here (JSON) and stop")
    ap.add_argument("--target", type=Path, default=ROOT / "engine" / "bundled" / "target")
    ap.add_argument("--out", type=Path)
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
    if a.out is None and a.save_prompts is None:
        ap.error("--out is required (unless --save-prompts)")
    if a.threads:
        torch.set_num_threads(a.threads)
    tok = Tokenizer.from_file(str(a.target / "tokenizer.json"))
    if a.prompts is not None:
        prompts = [Prompt(p["kind"], tuple(p["ids"])) for p in json.loads(a.prompts.read_text())]
    else:
        prompts = read_prompts(a.corpus, tok, {"chat": a.chat, "code": a.code, "fim": a.fim}, a.max_prompt, a.seed)
    if a.save_prompts is not None:
        a.save_prompts.write_text(json.dumps([{"kind": p.kind, "ids": list(p.ids)} for p in prompts]))
        print(json.dumps({"saved_prompts": len(prompts), "to": str(a.save_prompts)}))
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = tf.AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).to(device).eval()
    recorder = HiddenRecorder(model)
    rng = random.Random(a.seed)
    batches = batches_by_length(prompts, a.batch, rng)
    a.out.mkdir(parents=True, exist_ok=True)
    total = sum(len(p.ids) + a.new_tokens for p in prompts)  # an upper bound: rows may stop early
    slots, hidden = len(model.model.layers) + 1, model.config.hidden_size
    # written in place as batches finish: the features do not fit in memory twice
    tokens_out = np.lib.format.open_memmap(a.out / "tokens.npy", "w+", np.int32, (total,))
    feats_out = np.lib.format.open_memmap(a.out / "features.npy", "w+", np.float16, (total, slots, hidden))
    infos, start = [], 0
    t0 = time.perf_counter()
    for i, group in enumerate(batches):
        greedy = rng.random() >= a.sampled_share
        rows = continue_batch(model, recorder, [p.ids for p in group], a.new_tokens, greedy, a.seed * 100_003 + i,
                              a.temperature)
        for (tokens, feats), p in zip(rows, group):
            n = len(tokens)
            tokens_out[start : start + n] = tokens
            feats_out[start : start + n] = feats
            infos.append(SequenceInfo(start, len(p.ids), n, p.kind, greedy))
            start += n
        print(json.dumps({"batch": i + 1, "of": len(batches), "rows": len(group),
                          "prompt_len": max(len(p.ids) for p in group),
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
