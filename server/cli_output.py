"""What `spruce run` writes: the answer to stdout as it is generated, then its statistics to stderr,
so that stdout holds only the answer and can be piped."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Generator


def stream_answer(engine, request, steps: Generator, t0: float) -> None:
    """Write the text of `steps` (engine.generate(request), started at perf_counter t0) as it comes,
    then the statistics."""
    from server.streaming import TextAssembler

    assembler = TextAssembler(engine.tokenizer, [], request.sampling.stop_token_ids)
    first = stats = finish = None
    try:
        for step in steps:
            if first is None and step.token_ids:
                first = time.perf_counter() - t0
            delta = assembler.feed(step)
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.finish_reason is not None:
                stats, finish = delta.stats, delta.finish_reason
    finally:  # on Ctrl-C too: the engine's cleanup runs now, not whenever the generator is collected
        steps.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stats is not None:
        print_stats(stats, first, time.perf_counter() - t0, engine.memory(), finish)


FINISH_WORDS = {"stop": "stop (end of text)", "length": "length (--max-tokens or the context)"}


def print_stats(stats, ttft_s: float | None, duration_s: float, memory=None, finish: str | None = None) -> None:
    lines = [
        *([f"finish reason: {FINISH_WORDS.get(finish, finish)}"] if finish else []),
        f"generated tokens: {stats.generated_tokens}",
        f"time to first token: {ttft_s if ttft_s is not None else duration_s:.2f} s",
        f"prompt tokens: {stats.prompt_tokens} ({stats.cached_tokens} from the prefix cache)",
        f"prefill speed: {stats.prefill_tps:.2f} t/s",
        f"generation speed: {stats.decode_tps:.2f} t/s",
        f"tokens per forward pass: {stats.tokens_per_forward:.2f} t/f",
        *([f"speculation: {stats.accepted} of {stats.drafted} drafted tokens accepted; draft / verify / "
           f"commit {stats.draft_ms:.0f} / {stats.verify_ms:.0f} / {stats.commit_ms:.0f} ms"]
          if stats.drafted else []),
        f"memory used: {peak_rss_bytes() / 1e9:.2f} GB",
        *([f"weights: {memory.weights_bytes / 1e6:.1f} MB ({memory.dtype})"
           + (f" + draft {memory.draft_weights_bytes / 1e6:.1f} MB" if memory.draft_weights_bytes else "")
           + (f" + bfloat16 copies {memory.weight_copies_bytes / 1e6:.1f} MB" if memory.weight_copies_bytes else ""),
           f"caches: {memory.cache_bytes / 1e6:.2f} MB (this request's KV + GDN states); prefix cache "
           f"{memory.prefix_cache_bytes / 1e6:.2f} MB"] if memory is not None else []),
        f"duration: {duration_s:.2f} s",
    ]
    print("\n".join(lines), file=sys.stderr)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (MLX buffers live in it on CPU and Apple unified memory)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB
