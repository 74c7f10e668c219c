"""Every kernel body, as MLX would assemble it for Metal and for CUDA, compiles: with g++ against
the stubs in metal/stub/ (everywhere g++ is; CI), and with nvcc where CUDA's compiler is present.

This is the check the Metal text gets on machines without an Apple GPU: names, types and template
arguments, not Metal semantics (metal/README.md says what ran where)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.kernels import KERNELS, KernelSpec
from tests.kernels.render import render_cuda, render_metal

STUB = Path(__file__).resolve().parents[2] / "metal" / "stub"
INT_INPUTS = {"taps", "order", "depth", "path"}
# in the activations' dtype (bf16 on GPUs); everything else is float32 in the engine
ACTIVATIONS = {"qkv", "a", "b", "conv_state", "conv_w", "dt_bias", "conv_out", "x", "x_prev", "z", "out"}
# the bundled model's GDN shape and the 9B one; RPG / MAXD as the engine picks them
SHAPES = {"bundled": dict(Hk=6, Hv=12, Dk=32, Dv=32, K=4), "9b": dict(Hk=16, Hv=32, Dk=128, Dv=128, K=4)}


def dtypes_for(spec: KernelSpec, activations: str) -> dict[str, str]:
    out = {}
    for n in (*spec.inputs, *spec.outputs):
        if spec.name.startswith("spruce_choose"):  # logits in the activations' dtype, tokens int32
            out[n] = activations if n in ("logits", "raw") else "int32" if n == "tokens" else "float32"
        elif spec.name in ("spruce_add_norm", "spruce_gated_norm", "spruce_rms_norm", "spruce_swiglu",
                           "spruce_head_norms", "spruce_sigmoid_gate"):
            # o, w, qw, kw, eps fp32
            out[n] = activations if n in ("x", "y", "h", "out", "z", "gu", "q", "k", "v", "gate", "a", "g") \
                else "float32"
        elif spec.name.startswith("spruce_attn"):  # rows and cache in the activations' dtype, the mask bool
            out[n] = ("bool" if n == "ancestors" else "int32" if n in ("length", "srow")
                      else activations if n in ("q", "keys", "values", "skeys", "svalues", "o") else "float32")
        elif spec.name.endswith(("qmm_rows", "read_floor", "read_stream")) or "qmm_mma" in spec.name:
            out[n] = ("uint32" if n == "w" or (n == "y" and spec.name.endswith("stream"))
                      else "float32" if (n == "y" and spec.name.endswith("floor")) or n in ("nw", "eps")
                      else activations)
        else:
            out[n] = "int32" if n in INT_INPUTS else activations if n in ACTIVATIONS else "float32"
    return out


def template_for(spec: KernelSpec, shape: str, activations: str = "float32") -> dict[str, int | str]:
    if spec.name.endswith("qmm_rows"):
        return dict(OutT=activations, I=4096 if shape == "9b" else 384, O=256, GS=64, BITS=4, MAXM=8, R=4, RPG=4)
    if "qmm_mma" in spec.name:
        return dict(OutT=activations, GS=64, BITS=4, NT=3 if shape == "9b" else 1, RT=2, KW=8,
                    DQ=1 if shape == "9b" else 0)
    if spec.name.startswith("spruce_choose"):
        return dict(GREEDY=0, CAP=2048)
    if spec.name.endswith("read_stream"):
        return dict(OutT=activations)
    if spec.name.endswith("head_norms"):  # the bundled model's attention: 6 heads of 64, 2 K/V heads; the 9B's
        return dict(OutT=activations, H=16, HKV=4, D=256) if shape == "9b" else dict(OutT=activations, H=6, HKV=2, D=64)
    if spec.name.endswith(("add_norm", "gated_norm", "rms_norm", "swiglu", "sigmoid_gate")):
        return dict(OutT=activations)
    if spec.name.startswith("spruce_attn"):  # the bundled model's heads are 64 wide, the 9B's 256
        # the merge shared by 4 SIMD groups at the 9B's shape, walked by one at the bundled model's
        return dict(D=256 if shape == "9b" else 64, CH=32, KB=4, MB=4, MS=4 if shape == "9b" else 1, CPW=4,
                    OutT=activations)
    if spec.name.endswith("read_floor"):
        return dict(OutT=activations, WORDS=512 if shape == "9b" else 48, O=256, GS=64, BITS=4, R=8, RPG=4)
    t: dict[str, int | str] = dict(SHAPES[shape], RPG=2)
    if spec.name.endswith("gdn_step_gated"):
        t["OutT"] = activations
    if spec.name.endswith(("tree", "tree_fold")):
        t["MAXD"] = 16
    return t


def compile_cxx(source: str, tmp_path: Path, includes: list[Path]) -> subprocess.CompletedProcess:
    src = tmp_path / "kernel.cpp"
    src.write_text(source)
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-Wno-attributes", *(f"-I{p}" for p in includes), str(src)]
    return subprocess.run(cmd, capture_output=True, text=True)


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
CASES = [(spec, act, shape) for spec in KERNELS for act in ("float32", "bfloat16") for shape in SHAPES]


def ids(cases: list) -> list[str]:
    return [f"{s.name}-{a}-{sh}" for s, a, sh in cases]


# qmm_mma is CUDA only and takes bf16 / fp16 activations (tensor-core MMA)
METAL_CASES = [c for c in CASES if "metal" in c[0].backends]
CUDA_CASES = [c for c in CASES if "cuda" in c[0].backends and not ("qmm_mma" in c[0].name and c[1] == "float32")]


@needs_gxx
@pytest.mark.parametrize(("spec", "activations", "shape"), METAL_CASES, ids=ids(METAL_CASES))
def test_metal_text_compiles_against_the_stub(spec, activations, shape, tmp_path):
    sizes = {"path": 3}  # small arrays go to Metal's constant address space
    source = render_metal(spec, dtypes_for(spec, activations), sizes, template_for(spec, shape, activations))
    p = compile_cxx(source, tmp_path, [STUB])
    assert p.returncode == 0, p.stderr[-3000:]


@needs_gxx
@pytest.mark.parametrize(("spec", "activations", "shape"), CUDA_CASES, ids=ids(CUDA_CASES))
def test_cuda_text_compiles_against_the_stub(spec, activations, shape, tmp_path):
    source = render_cuda(spec, dtypes_for(spec, activations), template_for(spec, shape, activations), stub=True)
    p = compile_cxx(source, tmp_path, [STUB, STUB / "cuda"])
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("spec", KERNELS, ids=[s.name for s in KERNELS])
def test_cuda_text_compiles_with_nvcc(spec, tmp_path):
    source = render_cuda(spec, dtypes_for(spec, "bfloat16"), template_for(spec, "9b", "bfloat16"), stub=False)
    src = tmp_path / "kernel.cu"
    src.write_text(source)
    p = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-c", "-o", str(tmp_path / "k.o"), str(src)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]


def test_a_typo_in_a_body_fails_the_check(tmp_path, monkeypatch):
    """The check can fail: an undeclared name in a body is an error for both backends."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    import engine.kernels as kernels

    real = kernels.read_source
    monkeypatch.setattr(kernels, "read_source", lambda f: real(f).replace("spr_simd_sum(kv)", "spr_simd_summ(kv)"))
    spec = KERNELS[0]
    metal = render_metal(spec, dtypes_for(spec, "float32"), {}, template_for(spec, "bundled"))
    cuda = render_cuda(spec, dtypes_for(spec, "float32"), template_for(spec, "bundled"), stub=True)
    assert compile_cxx(metal, tmp_path, [STUB]).returncode != 0
    assert compile_cxx(cuda, tmp_path, [STUB, STUB / "cuda"]).returncode != 0


# an independent reading of C tokens: comments (skipped), literals, words, single characters
TOKEN = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'|\w+|\S", re.S)


def tokens(text: str) -> list[str]:
    return [t for t in TOKEN.findall(text) if not t.startswith(("//", "/*"))]


def directives(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if line.lstrip().startswith("#")]


@pytest.mark.parametrize("spec", KERNELS, ids=[s.name for s in KERNELS])
def test_compacted_text_keeps_every_token_and_directive(spec):
    """What MLX is handed (compact_source) is the sources' tokens in order, with each preprocessor
    directive still a line of its own, and is shorter."""
    import engine.kernels as kernels

    for backend in spec.backends:
        header = "".join(kernels.read_source(f) for f in (f"prelude_{backend}.h", *spec.header))
        body = kernels.read_source(spec.file)
        compact_header, compact_body = kernels.kernel_text(spec, backend)
        assert tokens(compact_header) == tokens(header)
        assert tokens(compact_body) == tokens(kernels.INDEX_NAMES[backend] + "".join(
            f"#define {d} 1\n" for d in spec.defines) + body)
        assert [d for d in directives(compact_header) if "//" not in d] == [
            " ".join(d.split("//")[0].split()) for d in directives(header)]
        assert len(compact_header) + len(compact_body) < len(header) + len(body)


def test_compact_source_keeps_literals_and_macro_lines():
    from engine.kernel_source import compact_source

    src = ('#define A(x)   \\\n  (x) /* one */ + 1   \\\n\n  // gone\nconst char* s = "a // b /* c */";  // tail\n'
           "int   c = '/';\n\n\n#define B \\\n\nint d;\n")
    out = compact_source(src)
    assert out == ('#define A(x) \\\n(x) + 1 \\\n\nconst char* s = "a // b /* c */";\nint c = \'/\';\n'
                   "#define B \\\n\nint d;\n")
    with pytest.raises(ValueError, match="unterminated"):
        compact_source("int a; /* never closed")
