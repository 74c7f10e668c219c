"""The `spruce` command: `spruce serve` (OpenAI-compatible HTTP server) and `spruce run` (one prompt).

`spruce run` streams the answer to stdout and prints its statistics to stderr afterwards
(server/cli_output.py), so stdout holds only the answer and can be piped.

On Linux the MLX CPU wheel ships a slow reference BLAS: when Debian/Ubuntu's OpenBLAS is
installed the command re-execs itself once with it in LD_PRELOAD, before mlx is imported, with
the engine's GEMV shim for products of a few rows ahead of it where a C compiler could build it (engine/blas.py;
SPRUCE_NO_BLAS_PRELOAD=1 turns both off, SPRUCE_NO_GEMV_SHIM=1 the shim).

Exit codes: 0, 2 for a usage or load error (one line on stderr), 130 when `run` is interrupted.
Before the process ends, the engine (its MLX arrays) is released and the engine thread joined:
MLX state torn down during interpreter exit aborts the process ("terminate called without an
active exception"). The process then ends through `leave` (os._exit, the streams flushed): the
C libraries' exit handlers are skipped, OpenBLAS's among them, which could hang after Ctrl-C.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import NoReturn

from engine.config import DTYPE_NAMES, KV_DTYPE_NAMES, SPEC_METHODS, SPEC_TREES
from server.bench.options import add_bench_parser
from server.cli_models import add_convert_parser, add_models_parser, cmd_convert, cmd_models
from server.cli_output import stream_answer
from server.cli_settings import DEFAULT_MAX_CONTEXT, Settings, SettingsError, engine_settings

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
ENGINE_STOP_S = 30.0  # after the HTTP server is down: how long the engine thread may take to stop


class CLIError(Exception):
    """A user-facing problem: printed as one line, exit code 2."""


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags of serve and run; defaults are None so that a --config preset can fill them
    (server/cli_settings.py holds the defaults, the checks and the merge)."""
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (org/name[@revision]); "
                                   "default: the bundled model")
    p.add_argument("--config", metavar="NAME|FILE",
                   help="a preset from configs/ (see `spruce models`) or a TOML file; flags override it")
    p.add_argument("--max-context", type=int,
                   help=f"context length in tokens (default: the model's trained length, at most "
                        f"{DEFAULT_MAX_CONTEXT})")
    p.add_argument("--dtype", choices=DTYPE_NAMES,
                   help="compute dtype of float weights (default auto: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES,
                   help="what the attention K/V cache stores (default auto: float16 on the CPU for a checkpoint "
                        "stored in 16-bit floats, else the compute dtype); a half dtype halves the cache and "
                        "what a decode step reads of it, each row rounded once as it is written; int8 (CPU "
                        "only) quantizes each row with its own scale, about half of float16, and may change "
                        "answers")
    p.add_argument("--spec", choices=("auto", *SPEC_METHODS),
                   help="speculative decoding: auto (default: what the model's preset measured to pay on this "
                        "hardware, else none), none, ngram (prompt lookup), draft (draft-model chain with "
                        "siblings), draft-tree (draft-model best-first tree), mtp (the checkpoint's "
                        "multi-token-prediction head), dflash (DFlash block drafter)")
    p.add_argument("--spec-budget", type=int, help="draft-tree nodes per round (default 16)")
    p.add_argument("--spec-depth", type=int, help="draft-tree depth (default 8; the MTP head: 6)")
    p.add_argument("--draft-model", help="draft checkpoint directory or repo id for --spec draft / draft-tree")
    p.add_argument("--spec-tree", choices=SPEC_TREES,
                   help="how mtp / dflash marginals become a tree: chain (top-1), ddtree (best-first product of "
                        "marginals, default), weaver (the Weaver adapter; needs one)")
    p.add_argument("--dflash-model", help="DFlash checkpoint directory for --spec dflash "
                                          "(default: the bundled one with the bundled model)")
    p.add_argument("--weaver-model", help="Weaver adapter directory for --spec-tree weaver "
                                          "(default: DFLASH_DIR/weaver)")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="tokens the mtp / dflash drafters may propose: the N most frequent of the model's "
                        "draft_vocab.safetensors ranking (default: its own size, the bundled model's 1024; "
                        "0: the whole vocabulary); fewer rows of the lm_head to read per drafted depth")
    p.add_argument("--spec-max-stall", type=float, metavar="X",
                   help="keep no draft tree whose round takes longer than X plain decoding steps (a round's "
                        "tokens arrive together, so this bounds the pauses a streaming client sees, at the "
                        "cost of the bigger trees' speed); default: no cap")
    p.add_argument("--spec-fixed", action="store_true",
                   help="every round drafts the full --spec-budget instead of a tree sized by the tokens per "
                        "second each request measures (the default, which falls back to plain rounds where "
                        "guesses miss); on a GPU where guesses hit, the fixed budget measured faster")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn off the prompt prefix cache")
    p.add_argument("--prefix-cache-bytes", type=int, help="prefix cache budget in bytes (default 2 GiB)")


def engine_config(a: argparse.Namespace) -> Settings:
    try:
        return engine_settings(a)
    except SettingsError as e:
        raise CLIError(str(e)) from None


def load_engine(config):
    """The engine, with its draft model when one is configured (a broken one is found at start,
    not by the first request that asks for it)."""
    from engine.generate import Engine

    try:
        engine = Engine(config)
    except Exception as e:  # any load failure is the user's checkpoint: one clear line, no traceback
        message = f"cannot load model from {config.model_path}: {e}"
    else:
        if not (config.spec.draft_model or config.spec.method in ("draft", "draft-tree")):
            return engine
        try:
            engine.draft_model(None)
            return engine
        except Exception as e:
            message = f"cannot load the draft model: {e}"
        del engine
    # Raised outside the except block: the failure's traceback holds the half-built model's MLX
    # arrays, and they must be freed now (release_mlx), not during interpreter exit.
    raise CLIError(message)


def warmed_engine(config, warmup: str):
    """load_engine, then the warm-up (engine/warmup.py) where `warmup` asks for it: on, or auto on
    a GPU backend."""
    from engine.kernels import gpu_backend

    engine = load_engine(config)
    if warmup == "on" or (warmup == "auto" and gpu_backend() is not None):
        from engine.warmup import warm_up

        print("spruce: warming up (running once what the first requests would otherwise compile)", file=sys.stderr)
        try:
            report = warm_up(engine)
        except Exception as e:
            del engine
            release_mlx()
            raise CLIError(f"the warm-up failed: {e}") from None
        print(f"spruce: warm-up done in {report.seconds:.1f} s", file=sys.stderr)
    return engine


def release_mlx() -> None:
    """Free MLX objects that only the cycle collector would find (a failed load leaves such cycles)
    while MLX is fully alive."""
    gc.collect()


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
                       help="tokens an answer gets when the request sets no limit, and the most any request may "
                            "ask for (default: 4096 for requests that set none, no cap for those that do)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model id /v1/models shows (default: the checkpoint's name); requests may name "
                            "any model")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="also answer requests whose Host header is NAME (repeatable); by default only "
                            "localhost and IP addresses are accepted, against DNS rebinding")
    serve.add_argument("--allow-any-host", action="store_true", help="turn the Host header check off")
    serve.add_argument("--show-model-path", action="store_true",
                       help="let /props show the model's directory path (default: only its name)")
    serve.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                       help="on SIGTERM / Ctrl-C, let the running request finish for up to S seconds (default 5)")
    serve.add_argument("--read-timeout", type=float, default=15.0, metavar="S",
                       help="a client must send a request's headers, and then its body, within S seconds each "
                            "(default 15)")
    serve.add_argument("--max-connections", type=int, default=128,
                       help="open connections at most; more get 503 (default 128)")
    serve.add_argument("--warmup", choices=("auto", "on", "off"), default="auto",
                       help="before serving, run once what the first requests would compile (auto, the default: "
                            "on a GPU, where MLX compiles each kernel variant on first use; off on the CPU)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    run = sub.add_parser("run", help="answer one prompt and print speed statistics to stderr")
    add_engine_args(run)
    run.add_argument("-m", "--message", help="the prompt (default: read stdin)")
    run.add_argument("--max-tokens", type=int, default=512)
    run.add_argument("--temperature", type=float, default=None,
                     help="0 = greedy (default: the checkpoint's generation_config.json, else 0)")
    run.add_argument("--top-p", type=float, default=None, help="default: the checkpoint's, else 1")
    run.add_argument("--top-k", type=int, default=None, help="default: the checkpoint's, else 0 (off)")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--ignore-eos", action="store_true",
                     help="generate --max-tokens tokens, past the end-of-text token (for timing)")
    run.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, without the chat template")
    run.add_argument("--think", action="store_true", help="let the model think first (off by default for run)")
    add_bench_parser(sub)
    add_convert_parser(sub)
    add_models_parser(sub)
    return ap


def cmd_serve(a: argparse.Namespace) -> int:
    from server.app import create_app
    from server.bridge import EngineBridge
    from server.memory import limit_malloc_arenas
    from server.serve import AddressInUse, SpruceConfig, SpruceServer, bind_socket, url_host, warn_if_exposed

    options = server_options(a)
    settings = engine_config(a)
    try:
        sock = bind_socket(a.host, a.port)  # before the model loads: a port in use is found at once
    except AddressInUse as e:
        raise CLIError(e.strerror) from None
    except OSError as e:
        raise CLIError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    limit_malloc_arenas()
    bridge = EngineBridge(lambda: warmed_engine(settings.config, a.warmup), max_queue=a.max_queue)
    try:
        bridge.start()
    except KeyboardInterrupt:  # while the model loads: MLX is busy on the engine thread, nothing to save
        print(file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)
    except BaseException:
        sock.close()
        release_mlx()
        raise
    try:
        assert bridge.engine is not None  # start() returned: the model is loaded
        for note in (*settings.notes, *bridge.engine.load_notes):
            print(f"spruce: {note}", file=sys.stderr)
        warn_if_exposed(a.host, options.api_key)
        name = options.served_model_name or bridge.engine.model_id
        print(f"spruce: serving {name} on http://{url_host(a.host)}:{a.port}/v1"
              + (" (API key required)" if options.api_key else ""), file=sys.stderr)
        uv_config = SpruceConfig(create_app(bridge, options), log_level=a.log_level, lifespan="off",
                                 head_timeout_s=a.read_timeout, max_connections=a.max_connections)
        # What exists now lives as long as the server: kept out of the cycle collector's full
        # passes, which otherwise scan it all (tens of ms with the GIL held) during big requests.
        gc.collect()
        gc.freeze()
        SpruceServer(uv_config, bridge, a.shutdown_timeout).run(sockets=[sock])
    finally:
        sock.close()
        stop_engine(bridge)
    return 0


def stop_engine(bridge) -> None:
    """Stop and join the engine thread, then free the engine while MLX is alive. If the thread will
    not stop (a long prefill), leave at once rather than let interpreter exit tear MLX down under it."""
    if not bridge.stop(ENGINE_STOP_S):
        print(f"spruce: the engine did not stop within {ENGINE_STOP_S:g} s; exiting anyway", file=sys.stderr)
        sys.stderr.flush()
        os._exit(0)
    bridge.engine = None
    release_mlx()


def server_options(a: argparse.Namespace):
    from server.http_guards import is_ip_literal
    from server.planning import ServerOptions

    if a.max_queue < 1:
        raise CLIError(f"--max-queue must be >= 1, got {a.max_queue}")
    if a.max_tokens is not None and a.max_tokens < 0:
        raise CLIError(f"--max-tokens must be >= 0, got {a.max_tokens}")
    for flag, value in (("--shutdown-timeout", a.shutdown_timeout), ("--read-timeout", a.read_timeout)):
        if not value >= 0 or value == float("inf"):
            raise CLIError(f"{flag} must be a number of seconds >= 0, got {value}")
    if a.read_timeout == 0:
        raise CLIError("--read-timeout must be more than 0 s")
    if a.max_connections < 1:
        raise CLIError(f"--max-connections must be >= 1, got {a.max_connections}")
    key = a.api_key if a.api_key is not None else os.environ.get("SPRUCE_API_KEY") or None
    if key is not None and not key.strip():
        raise CLIError("--api-key is empty")
    hosts = tuple(a.allowed_host) + ((a.host,) if not is_ip_literal(a.host) else ())
    if a.served_model_name is not None and not a.served_model_name.strip():
        raise CLIError("--served-model-name is empty")
    return ServerOptions(max_tokens_cap=a.max_tokens, served_model_name=a.served_model_name, api_key=key,
                         cors_origins=tuple(a.cors_origin),
                         allowed_hosts=hosts, check_host=not a.allow_any_host, show_model_path=a.show_model_path,
                         read_timeout_s=a.read_timeout)


def cmd_run(a: argparse.Namespace) -> int:
    prompt = a.message if a.message is not None else _read_stdin()
    settings = engine_config(a)
    try:
        engine = load_engine(settings.config)
    except CLIError:
        release_mlx()
        raise
    for note in (*settings.notes, *engine.load_notes):
        print(f"spruce: {note}", file=sys.stderr)
    try:
        ids = engine.tokenizer.encode(prompt) if a.no_chat else _chat_ids(engine.tokenizer, prompt, a.think)
        request = _run_request(engine, ids, a)
        t0 = time.perf_counter()
        try:
            steps = engine.generate(request)
        except ValueError as e:  # the engine refused the request (empty prompt, bad ids)
            raise CLIError(str(e)) from None
        stream_answer(engine, request, steps, t0)
    finally:
        del engine
        release_mlx()
    return 0


def _read_stdin() -> str:
    text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    if not text.strip():
        raise CLIError("no prompt: pass -m \"PROMPT\" or pipe it on stdin")
    return text


def _chat_ids(tokenizer, prompt: str, think: bool) -> list[int]:
    """The prompt as a user message; special tokens spelled out in it stay text (--no-chat: raw)."""
    from server.chat import ChatRenderOptions, ChatTemplate, ChatTemplateError

    template = ChatTemplate.of(tokenizer)
    try:
        rendered = template.render_prompt([{"role": "user", "content": prompt}],
                                          ChatRenderOptions(enable_thinking=think))
    except ChatTemplateError as e:
        raise CLIError(f"{e} (or pass --no-chat)") from None
    return template.guard.encode(tokenizer, rendered)


def _run_request(engine, ids: list[int], a: argparse.Namespace):
    from engine.config import SamplingParams
    from engine.types import GenerationRequest

    if len(ids) >= engine.config.max_context:
        raise CLIError(f"the prompt has {len(ids)} tokens; the context holds {engine.config.max_context} "
                       "(raise --max-context)")
    d = engine.sampling_defaults  # generation_config.json: what the checkpoint's authors sample with

    def pick(flag, default, fallback):
        return flag if flag is not None else default if default is not None else fallback

    try:
        sampling = SamplingParams(
            temperature=pick(a.temperature, d.temperature, 0.0), top_p=pick(a.top_p, d.top_p, 1.0),
            top_k=pick(a.top_k, d.top_k, 0), min_p=pick(None, d.min_p, 0.0),
            repetition_penalty=pick(None, d.repetition_penalty, 1.0), seed=a.seed, max_tokens=a.max_tokens,
            stop_token_ids=() if a.ignore_eos else engine.tokenizer.eos_token_ids, ignore_eos=a.ignore_eos)
    except ValueError as e:
        raise CLIError(str(e)) from None
    return GenerationRequest(prompt_ids=ids, sampling=sampling, request_id="cli")


def cmd_bench(a: argparse.Namespace) -> int:
    from server.bench.command import BenchError, bench_command

    try:
        return bench_command(a)
    except BenchError as e:
        raise CLIError(str(e)) from None


COMMANDS = {"serve": cmd_serve, "run": cmd_run, "bench": cmd_bench, "convert": cmd_convert, "models": cmd_models}


def main(argv: list[str] | None = None) -> int:
    """The command line (argv None: the process's own, which ends in `leave`) or `argv` in-process
    (tests): -> the exit code."""
    if argv is not None:
        return run_command(argv)
    from engine.blas import reexec_with_openblas

    hint = reexec_with_openblas(sys.orig_argv[1:])
    if hint:
        print(hint, file=sys.stderr)
    try:
        code = run_command(None)
    except SystemExit as e:  # argparse's usage errors and --help
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as Python would, then out the same way
        import traceback

        traceback.print_exc()
        code = 1
    leave(code)


def leave(code: int) -> NoReturn:
    """End the process without the C libraries' exit handlers. OpenBLAS's (the pthread build that
    engine/blas.py preloads, 0.3.21 on Debian 12) joins its worker threads, and after `spruce run`
    was interrupted it waited forever on a worker that never woke (gdb: `gotoblas_quit ->
    blas_thread_shutdown_ -> pthread_join` from `exit(130)`; one of the three Ctrl-C runs of
    tests/e2e/test_cli.py in a fresh install). What those handlers would do, the operating system
    does anyway; what Python's exit would do that matters here is flushing the streams."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a closed stream: nothing to flush to
            pass
    os._exit(code)


def run_command(argv: list[str] | None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return COMMANDS[a.command](a)
    except (CLIError, SettingsError) as e:
        print(f"spruce: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BaseException as e:
        if not interrupted(e):
            raise
    # Here the interruption and the frames its traceback held (with MLX arrays) are gone.
    release_mlx()
    print(file=sys.stderr)
    return EXIT_INTERRUPTED


def interrupted(e: BaseException | None) -> bool:
    """Ctrl-C, or an error raised while the code that Ctrl-C interrupted was cleaning up."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
