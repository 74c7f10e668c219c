"""The `spruce` command: `spruce serve` (OpenAI-compatible HTTP server) and `spruce run` (one prompt).

`spruce run` streams the answer to stdout and prints its statistics to stderr afterwards, so
stdout holds only the answer and can be piped.

On Linux the MLX CPU wheel ships a slow reference BLAS: when Debian/Ubuntu's OpenBLAS is
installed the command re-execs itself once with it in LD_PRELOAD, before mlx is imported
(engine/blas.py; SPRUCE_NO_BLAS_PRELOAD=1 turns this off).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
import time
from pathlib import Path

from engine.config import SPEC_METHODS, SPEC_TREES

EXIT_USAGE = 2
M_ARENA_MAX = -8  # glibc mallopt parameter


class CLIError(Exception):
    """A user-facing problem: printed as one line, exit code 2."""


def bundled_model_dir() -> Path:
    import engine

    return Path(engine.__file__).resolve().parent / "bundled" / "target"


def resolve_model(arg: str | None) -> Path:
    if arg is None:
        path = bundled_model_dir()
        if not (path / "config.json").is_file():
            raise CLIError("no bundled model in this install; pass --model DIR")
        return path
    path = Path(arg).expanduser()
    if not path.exists():
        raise CLIError(f"--model {arg}: no such directory")
    if not path.is_dir():
        raise CLIError(f"--model {arg}: not a directory (pass the checkpoint directory)")
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        raise CLIError(f"--model {arg}: not a checkpoint directory (missing {', '.join(missing)})")
    return path


def resolve_dir(arg: str, flag: str) -> Path:
    """A drafter directory (DFlash, Weaver): it must hold a config.json."""
    path = Path(arg).expanduser()
    if not path.is_dir():
        raise CLIError(f"{flag} {arg}: no such directory")
    if not (path / "config.json").is_file():
        raise CLIError(f"{flag} {arg}: not a checkpoint directory (missing config.json)")
    return path


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the bundled model)")
    p.add_argument("--max-context", type=int, default=8192, help="context length in tokens (default 8192)")
    p.add_argument("--spec", choices=SPEC_METHODS, default="none",
                   help="speculative decoding: none, ngram (prompt lookup), draft (draft-model chain with "
                        "siblings), draft-tree (draft-model best-first tree), mtp (the checkpoint's "
                        "multi-token-prediction head), dflash (DFlash block drafter)")
    p.add_argument("--spec-budget", type=int, default=16, help="draft-tree nodes per round (default 16)")
    p.add_argument("--spec-depth", type=int, default=8, help="draft-tree depth (default 8)")
    p.add_argument("--spec-tree", choices=SPEC_TREES, default="ddtree",
                   help="how mtp / dflash marginals become a tree: chain (top-1), ddtree (best-first product of "
                        "marginals, default), weaver (the Weaver adapter; needs one)")
    p.add_argument("--draft-model", help="draft checkpoint directory for --spec draft")
    p.add_argument("--dflash-model", help="DFlash checkpoint directory for --spec dflash "
                                          "(default: the bundled one with the bundled model)")
    p.add_argument("--weaver-model", help="Weaver adapter directory for --spec-tree weaver "
                                          "(default: DFLASH_DIR/weaver)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn off the prompt prefix cache")
    p.add_argument("--prefix-cache-bytes", type=int, default=2 << 30, help="prefix cache budget in bytes")


def engine_config(a: argparse.Namespace):
    from engine.config import EngineConfig, SpecConfig

    model = resolve_model(a.model)
    draft = str(resolve_model(a.draft_model)) if a.draft_model else None
    dflash = str(resolve_dir(a.dflash_model, "--dflash-model")) if a.dflash_model else None
    weaver = str(resolve_dir(a.weaver_model, "--weaver-model")) if a.weaver_model else None
    try:
        spec = SpecConfig(method=a.spec, budget=a.spec_budget, max_depth=a.spec_depth, draft_model=draft,
                          tree=a.spec_tree, dflash_model=dflash, weaver_model=weaver)
        return EngineConfig(model_path=str(model), max_context=a.max_context, spec=spec,
                            prefix_cache=not a.no_prefix_cache, prefix_cache_bytes=a.prefix_cache_bytes)
    except ValueError as e:
        raise CLIError(str(e)) from None


def load_engine(config):
    from engine.generate import Engine

    try:
        return Engine(config)
    except Exception as e:  # any load failure is the user's checkpoint: one clear line, no traceback
        raise CLIError(f"cannot load model from {config.model_path}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spruce", description="OpenAI-compatible local LLM server on MLX")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-queue", type=int, default=32, help="requests that may wait for the slot (default 32)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health (default: env "
                            "SPRUCE_API_KEY, else no key)")
    serve.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="allow browser requests from ORIGIN (repeatable; '*' for any); CORS is off by default")
    serve.add_argument("--max-tokens", type=int, default=None,
                       help="most tokens one answer may generate, whatever the request asks (default: no cap)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    run = sub.add_parser("run", help="answer one prompt and print speed statistics to stderr")
    add_engine_args(run)
    run.add_argument("-m", "--message", help="the prompt (default: read stdin)")
    run.add_argument("--max-tokens", type=int, default=512)
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, without the chat template")
    run.add_argument("--think", action="store_true", help="let the model think first (off by default for run)")
    return ap


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from server.app import create_app
    from server.bridge import EngineBridge

    options = server_options(a)
    config = engine_config(a)
    limit_malloc_arenas()
    bridge = EngineBridge(lambda: load_engine(config), max_queue=a.max_queue)
    bridge.start()
    print(f"spruce: serving {bridge.engine.model_id} on http://{a.host}:{a.port}/v1"
          + (" (API key required)" if options.api_key else ""), file=sys.stderr)
    uvicorn.run(create_app(bridge, options), host=a.host, port=a.port, log_level=a.log_level)
    bridge.stop()
    return 0


def limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives threads that allocate their own malloc arenas (up to 8 per core) and seldom hands
    their memory back, so a long-running server's RSS creeps up with its threads (event loop,
    planning, engine, BLAS). Two arenas keep it flat under load (scripts/load_test.py). Call before
    threads start; a no-op off glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_ARENA_MAX, arenas)
    except (OSError, AttributeError):
        pass  # not glibc (musl, ...)


def server_options(a: argparse.Namespace):
    from server.planning import ServerOptions

    if a.max_queue < 1:
        raise CLIError(f"--max-queue must be >= 1, got {a.max_queue}")
    if a.max_tokens is not None and a.max_tokens < 0:
        raise CLIError(f"--max-tokens must be >= 0, got {a.max_tokens}")
    key = a.api_key if a.api_key is not None else os.environ.get("SPRUCE_API_KEY") or None
    if key is not None and not key.strip():
        raise CLIError("--api-key is empty")
    return ServerOptions(max_tokens_cap=a.max_tokens, api_key=key, cors_origins=tuple(a.cors_origin))


def cmd_run(a: argparse.Namespace) -> int:
    prompt = a.message if a.message is not None else _read_stdin()
    engine = load_engine(engine_config(a))
    ids = engine.tokenizer.encode(prompt if a.no_chat else _render_chat(engine.tokenizer, prompt, a.think))
    request = _run_request(engine, ids, a)
    _generate_and_print(engine, request)
    return 0


def _read_stdin() -> str:
    text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    if not text.strip():
        raise CLIError("no prompt: pass -m \"PROMPT\" or pipe it on stdin")
    return text


def _render_chat(tokenizer, prompt: str, think: bool) -> str:
    from server.chat import ChatRenderOptions, ChatTemplate, ChatTemplateError

    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    try:
        return template.render([{"role": "user", "content": prompt}], ChatRenderOptions(enable_thinking=think))
    except ChatTemplateError as e:
        raise CLIError(f"{e} (or pass --no-chat)") from None


def _run_request(engine, ids: list[int], a: argparse.Namespace):
    from engine.config import SamplingParams
    from engine.types import GenerationRequest

    if len(ids) >= engine.config.max_context:
        raise CLIError(f"the prompt has {len(ids)} tokens; the context holds {engine.config.max_context} "
                       "(raise --max-context)")
    try:
        sampling = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                                  max_tokens=a.max_tokens, stop_token_ids=engine.tokenizer.eos_token_ids)
    except ValueError as e:
        raise CLIError(str(e)) from None
    return GenerationRequest(prompt_ids=ids, sampling=sampling, request_id="cli")


def _generate_and_print(engine, request) -> None:
    from server.streaming import TextAssembler

    assembler = TextAssembler(engine.tokenizer, [], request.sampling.stop_token_ids)
    t0 = time.perf_counter()
    first = stats = None
    try:
        steps = engine.generate(request)
    except ValueError as e:  # the engine refused the request (empty prompt, bad ids)
        raise CLIError(str(e)) from None
    for step in steps:
        if first is None and step.token_ids:
            first = time.perf_counter() - t0
        delta = assembler.feed(step)
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        if delta.finish_reason is not None:
            stats = delta.stats
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stats is not None:
        print_stats(stats, first, time.perf_counter() - t0)


def print_stats(stats, ttft_s: float | None, duration_s: float) -> None:
    lines = [
        f"time to first token: {ttft_s if ttft_s is not None else duration_s:.2f} s",
        f"prompt tokens: {stats.prompt_tokens} ({stats.cached_tokens} from the prefix cache)",
        f"prefill speed: {stats.prefill_tps:.2f} t/s",
        f"generation speed: {stats.decode_tps:.2f} t/s",
        f"tokens per forward pass: {stats.tokens_per_forward:.2f} t/f",
        *([f"speculation: {stats.accepted} of {stats.drafted} drafted tokens accepted; draft / verify / "
           f"commit {stats.draft_ms:.0f} / {stats.verify_ms:.0f} / {stats.commit_ms:.0f} ms"]
          if stats.drafted else []),
        f"memory used: {peak_rss_bytes() / 1e9:.2f} GB",
        f"duration: {duration_s:.2f} s",
    ]
    print("\n".join(lines), file=sys.stderr)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (MLX buffers live in it on CPU and Apple unified memory)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a real command line: in-process callers (tests) are never re-exec'd
        from engine.blas import reexec_with_openblas

        hint = reexec_with_openblas(sys.orig_argv[1:])
        if hint:
            print(hint, file=sys.stderr)
    a = build_parser().parse_args(argv)
    try:
        return cmd_serve(a) if a.command == "serve" else cmd_run(a)
    except CLIError as e:
        print(f"spruce: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
