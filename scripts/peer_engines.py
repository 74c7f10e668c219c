"""How scripts/bench_peers.py starts each engine on one checkpoint: the command line, the checkpoint
copy or conversion it needs, and what to call its weights in the table.

Engines: Spruce with each speculation method (spruce-none, spruce-ngram, spruce-draft,
spruce-draft-tree), mlx-lm's server (mlx-lm; mlx-lm-draft with its own speculative decoding), and
llama.cpp's llama-server (llama.cpp; llama.cpp-ngram and llama.cpp-draft with its own). Each runs
with its own default speculation settings. An engine that cannot run here raises Unavailable with
the reason, which goes into the table instead of a row.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "engine" / "bundled"
SPRUCE_METHODS = {"spruce-none": "none", "spruce-ngram": "ngram", "spruce-draft": "draft",
                  "spruce-draft-tree": "draft-tree"}
LLAMA_CPP_SPEC = {"llama.cpp": None, "llama.cpp-ngram": "ngram-simple", "llama.cpp-draft": "draft-simple"}
ENGINES = (*SPRUCE_METHODS, "mlx-lm", "mlx-lm-draft", *LLAMA_CPP_SPEC)
OPENBLAS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
            "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3")

# Runs llama.cpp's converter; a byte-level BPE tokenizer whose pre-tokenizer hash the converter does
# not list (this project's own tokenizers) is the GPT-2 regex, which llama.cpp calls "gpt-2".
CONVERT_WRAPPER = """
import os, runpy, sys
converter = sys.argv[1]
sys.argv = [converter] + sys.argv[2:]
sys.path.insert(0, os.path.dirname(converter))
try:
    from conversion.base import TextModel
except ImportError:
    TextModel = None
if TextModel is not None and os.environ.get("SPRUCE_GPT2_PRETOKENIZER"):
    original = TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print("bench_peers: unlisted byte-level BPE pre-tokenizer: writing 'gpt-2'", file=sys.stderr)
            return "gpt-2"
    TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(converter, run_name="__main__")
"""


# mlx-lm's server, where the checkpoint was relabelled qwen3_5_text -> qwen3_5 for it: transformers 5
# then swaps in Qwen3.5's own tokenizer class (another pre-tokenizer: digits split one by one) for
# the checkpoint's tokenizer.json, and prompts would not be the same tokens as in the other engines.
MLX_LM_SERVER_OWN_TOKENIZER = """
import sys
from transformers.models.auto import tokenization_auto
tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard("qwen3_5")
from mlx_lm.server import main
sys.argv = ["mlx_lm.server"] + sys.argv[1:]
main()
"""


class Unavailable(Exception):
    """The engine cannot run on this machine with this checkpoint; the message says why."""


@dataclass(frozen=True)
class PeerOptions:
    model: Path
    draft_model: Path | None
    work: Path  # converted checkpoints and GGUF files
    context: int  # context to start servers with
    mlx_lm_dtype: str = "float32"  # float32: compute as Spruce does; as-is: the file's dtype
    mlx_lm_draft_tokens: int = 3
    llama_server: str | None = None
    llama_convert: str | None = None
    gguf: Path | None = None
    gguf_type: str = "f32"
    spec_budget: int = 16
    spec_depth: int | None = None  # None: Spruce's default for the method
    threads: int | None = None  # CPU threads per engine (BLAS for Spruce and mlx-lm, -t for llama.cpp)


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    extra_body: dict = field(default_factory=dict)  # per-request fields this engine needs (cache off)
    info: dict = field(default_factory=dict)  # for the table: weights, command, version


def prepare(name: str, opts: PeerOptions, port: int) -> Launch:
    if name in SPRUCE_METHODS:
        return _spruce(SPRUCE_METHODS[name], opts, port)
    if name in ("mlx-lm", "mlx-lm-draft"):
        return _mlx_lm(opts, port, draft=name == "mlx-lm-draft")
    if name in LLAMA_CPP_SPEC:
        return _llama_cpp(opts, port, LLAMA_CPP_SPEC[name])
    raise Unavailable(f"unknown engine {name!r} (known: {', '.join(ENGINES)})")


def display_command(argv: list[str]) -> str:
    """The command for the table, with paths cut to their last part (no machine paths in reports)."""
    def short(arg: str) -> str:
        if arg == sys.executable:
            return "python"
        return Path(arg).name if os.sep in arg and Path(arg).exists() else arg
    return " ".join(short(a) for a in argv)


def checkpoint_dtype(path: Path) -> str:
    cfg = _config(path)
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("bits"):
        return f"{q['bits']}-bit g{q.get('group_size', '?')}"
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype") or "?")


def model_context(path: Path) -> int | None:
    cfg = _config(path)
    text = {**cfg, **(cfg.get("text_config") or {})}
    n = text.get("max_position_embeddings")
    return int(n) if n else None


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _base_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = str(threads)
    return env


def _spruce(method: str, opts: PeerOptions, port: int) -> Launch:
    draft = opts.draft_model or _bundled_draft_for(opts.model)
    if method in ("draft", "draft-tree") and draft is None:
        raise Unavailable("no draft model for this checkpoint (pass --draft-model DIR)")
    argv = [sys.executable, "-m", "server", "serve", "--model", str(opts.model), "--host", "127.0.0.1",
            "--port", str(port), "--spec", method, "--spec-budget", str(opts.spec_budget),
            "--max-context", str(opts.context), "--no-prefix-cache", "--log-level", "warning"]
    if opts.spec_depth is not None:
        argv += ["--spec-depth", str(opts.spec_depth)]
    if draft is not None and method in ("draft", "draft-tree"):
        argv += ["--draft-model", str(draft)]
    # Spruce's --dtype auto computes float weights in float32 on the CPU, bfloat16 on a GPU
    # (engine/dtypes.py); it preloads OpenBLAS itself.
    from engine.dtypes import resolve_dtype

    compute = {"float32": "f32", "bfloat16": "bf16"}[resolve_dtype("auto")]
    return Launch(argv, _base_env(opts.threads), REPO,
                  info={"weights": f"{checkpoint_dtype(opts.model)} file, {compute} compute",
                        "command": display_command(argv)})


def _bundled_draft_for(model: Path) -> Path | None:
    target, draft = BUNDLED / "target", BUNDLED / "draft"
    if model.resolve() == target.resolve() and (draft / "config.json").is_file():
        return draft
    return None


def _mlx_lm(opts: PeerOptions, port: int, draft: bool) -> Launch:
    if importlib.util.find_spec("mlx_lm") is None:
        raise Unavailable("mlx-lm is not installed (pip install mlx-lm)")
    draft_src = opts.draft_model or _bundled_draft_for(opts.model)
    if draft and draft_src is None:
        raise Unavailable("no draft model for this checkpoint (pass --draft-model DIR)")
    model_dir = mlx_lm_checkpoint(opts.model, opts.work, opts.mlx_lm_dtype)
    relabelled = _config(opts.model).get("model_type") == "qwen3_5_text"
    server = ["-c", MLX_LM_SERVER_OWN_TOKENIZER] if relabelled else ["-m", "mlx_lm", "server"]
    argv = [sys.executable, *server, "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--prompt-cache-size", "0", "--log-level", "WARNING"]
    if draft and draft_src is not None:
        argv += ["--draft-model", str(mlx_lm_checkpoint(draft_src, opts.work, opts.mlx_lm_dtype)),
                 "--num-draft-tokens", str(opts.mlx_lm_draft_tokens)]
    env = _base_env(opts.threads)
    # Its /v1/models lists the Hugging Face cache and fails when there is none; no hub access either.
    hub = opts.work / "hf-cache"
    hub.mkdir(parents=True, exist_ok=True)
    env.update(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    blas = next((p for p in OPENBLAS if os.path.exists(p)), None)
    if platform.system() == "Linux" and blas and "openblas" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (blas, env.get("LD_PRELOAD", "")) if p)  # as Spruce does
    weights = (f"{checkpoint_dtype(opts.model)} file, f32 copy" if opts.mlx_lm_dtype == "float32"
               else f"{checkpoint_dtype(opts.model)} file, as is")
    shown = display_command(argv).replace(f"-c {MLX_LM_SERVER_OWN_TOKENIZER}", "-m mlx_lm server")
    if relabelled:
        shown += " (transformers told to keep the checkpoint's tokenizer.json)"
    return Launch(argv, env, REPO, info={"weights": weights, "command": shown,
                                         "version": f"mlx-lm {_version('mlx-lm')}, mlx {_version('mlx')}"})


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def mlx_lm_checkpoint(src: Path, work: Path, dtype: str) -> Path:
    """A copy mlx-lm loads like Spruce does: model_type qwen3_5_text relabelled qwen3_5 (mlx-lm
    knows only the latter), and with dtype float32 every float tensor cast to float32 before
    mlx-lm adds +1 to the zero-centred norms (in bf16 that add rounds, and greedy text drifts)."""
    cfg = _config(src)
    relabel = cfg.get("model_type") == "qwen3_5_text"
    if dtype == "as-is" and not relabel:
        return src
    out = work / f"mlx-lm-{src.resolve().name}-{dtype}"
    if (out / "config.json").is_file():  # written last: a complete copy
        return out
    if relabel:
        cfg["model_type"] = "qwen3_5"
        interval = _attention_interval(cfg)
        if interval is not None:
            cfg["full_attention_interval"] = interval
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name == "config.json":
            continue
        if f.suffix == ".safetensors" and dtype == "float32":
            _cast_safetensors(f, out / f.name)
        else:
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _attention_interval(cfg: dict) -> int | None:
    """full_attention_interval matching HF's layer_types list: mlx-lm reads only the interval
    (default 4), so a 2-layer draft with layers (linear, full) needs 2 written down."""
    types = cfg.get("layer_types")
    if not types:
        return None
    for k in range(1, len(types) + 1):
        if all((t == "full_attention") == ((i + 1) % k == 0) for i, t in enumerate(types)):
            return k
    raise Unavailable("mlx-lm cannot express this checkpoint's layer_types (attention layers not periodic)")


def _cast_safetensors(src: Path, dst: Path) -> None:
    import mlx.core as mx

    arrays, meta = mx.load(str(src), return_metadata=True)  # a .safetensors file: (dict of arrays, dict)
    assert isinstance(arrays, dict) and isinstance(meta, dict)
    cast = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in arrays.items()}
    mx.save_safetensors(str(dst), cast, metadata={str(k): str(v) for k, v in meta.items()})


def _llama_cpp(opts: PeerOptions, port: int, spec: str | None) -> Launch:
    server = opts.llama_server or shutil.which("llama-server")
    if server is None or not Path(server).is_file():
        raise Unavailable("no llama-server binary (pass --llama-server PATH; BENCHMARKS.md says how it was built)")
    gguf = opts.gguf or _convert_gguf(opts, opts.model, Path(server))
    argv = [server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(opts.context),
            "-np", "1", "--jinja", "--no-webui", "--no-cache-prompt"]
    if opts.threads is not None:
        argv += ["-t", str(opts.threads)]
    if spec == "draft-simple":
        draft = opts.draft_model or _bundled_draft_for(opts.model)
        if draft is None:
            raise Unavailable("no draft model for this checkpoint (pass --draft-model DIR)")
        argv += ["--spec-type", spec, "-md", str(_convert_gguf(opts, draft, Path(server)))]
    elif spec is not None:
        argv += ["--spec-type", spec]
    version = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=60)
    build = next((line.split("version:", 1)[-1] for line in (version.stdout + version.stderr).splitlines()
                  if "version" in line), "?")
    weights = f"GGUF {opts.gguf_type}" if opts.gguf is None else f"GGUF {Path(gguf).name}"
    return Launch(argv, dict(os.environ), REPO,
                  info={"weights": weights, "command": display_command(argv), "version": f"llama.cpp {build.strip()}"})


def _convert_gguf(opts: PeerOptions, model: Path, server: Path) -> Path:
    converter = Path(opts.llama_convert) if opts.llama_convert else _find_converter(server)
    if converter is None:
        raise Unavailable("no GGUF file and no convert_hf_to_gguf.py found (pass --gguf FILE or --llama-convert)")
    out = opts.work / f"{model.resolve().name}-{opts.gguf_type}.gguf"
    if out.is_file():
        return out
    env = dict(os.environ)
    if _byte_level_bpe(model):
        env["SPRUCE_GPT2_PRETOKENIZER"] = "1"
    opts.work.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-c", CONVERT_WRAPPER, str(converter), str(model), "--outfile", str(out),
            "--outtype", opts.gguf_type, "--no-mtp"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(f"GGUF conversion of {model.name} failed: {tail[0][:300]}")
    return out


def _find_converter(server: Path) -> Path | None:
    for parent in list(server.resolve().parents)[:4]:
        if (parent / "convert_hf_to_gguf.py").is_file():
            return parent / "convert_hf_to_gguf.py"
    return None


def _byte_level_bpe(model: Path) -> bool:
    try:
        pre = json.loads((model / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    except (OSError, json.JSONDecodeError):
        return False
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
