"""Registers, spills and shared memory of qmm_mma's builds, as nvcc's assembler reports them.

    python scripts/kernel_registers.py [--nt 1,3,4] [--kw 4,16] [--dq 0,1] [--rt 1]
                                       [--builds plain,norm,res,swiglu,swiglu-res] [--ptx]

Where nvcc is (the GPU machine; the dev machine has one too). Renders the exact text MLX hands
NVRTC (tests/kernels/render.py) for each template and compiles it for sm_90 with `-Xptxas -v`: a
build that spills or needs more registers than its block size allows explains a slow
configuration before any timing does. `--ptx` adds the PTX instructions of the loop over the
reduction's steps (the biggest loop with MMAs in it; where the compiler keeps an inner loop rolled,
as at NT = 3, that inner loop) and how many are MMAs, and their ratio: at one row the kernel
is bound by what it issues (BENCHMARKS.md, issue 13), so this is a first reading of a change where
no GPU is to be had. PTX, not the machine code: ptxas merges masks into LOP3 and drops the moves
of register pairs, so compare two builds' counts, not a count with a profile's.
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine and tests helpers

from engine.kernels import (  # noqa: E402
    QMM_MMA,
    QMM_MMA_NORM,
    QMM_MMA_RES,
    QMM_MMA_SWIGLU,
    QMM_MMA_SWIGLU_RES,
    KernelSpec,
)
from tests.kernels.render import render_cuda  # noqa: E402

DTYPES = {"x": "bfloat16", "w": "uint32", "scales": "bfloat16", "biases": "bfloat16", "y": "bfloat16",
          "nw": "bfloat16", "eps": "float32", "res": "bfloat16"}
BUILDS = {"plain": QMM_MMA, "norm": QMM_MMA_NORM, "res": QMM_MMA_RES, "swiglu": QMM_MMA_SWIGLU,
          "swiglu-res": QMM_MMA_SWIGLU_RES}  # engine.qmm.MMA_BUILDS by the names of bench_qmm --builds


def ptxas_report(spec: KernelSpec, template: dict[str, int | str], work: Path) -> str:
    src = work / "qmm_mma.cu"
    src.write_text(render_cuda(spec, DTYPES, template, stub=False))
    p = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-Xptxas", "-v", "-c", "-o", str(work / "k.o"),
                        str(src)], capture_output=True, text=True)
    if p.returncode:
        return "compile failed: " + p.stderr.strip().splitlines()[-1]
    used = re.search(r"Used (\d+) registers", p.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", p.stderr)
    return (f"{used.group(1) if used else '?'} registers, "
            f"spill stores/loads {spill.group(1)}/{spill.group(2)} bytes" if spill else p.stderr.strip())


def ptx_step(spec: KernelSpec, template: dict[str, int | str], work: Path) -> str:
    """The PTX instructions (and MMAs) of the build's step loop."""
    src, ptx = work / "qmm_mma.cu", work / "qmm_mma.ptx"
    src.write_text(render_cuda(spec, DTYPES, template, stub=False))
    p = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-ptx", "-o", str(ptx), str(src)],
                       capture_output=True, text=True)
    if p.returncode:
        return "compile failed: " + p.stderr.strip().splitlines()[-1]
    lines = ptx.read_text().splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.match(r"^\$L__BB\d+_\d+:$", line.strip())}
    best: tuple[int, int] | None = None
    for i, line in enumerate(lines):
        jump = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if jump is None or labels.get(jump.group(1), i) >= i:
            continue  # not a jump back: not a loop
        # an inline asm block puts its instruction after the "{"
        body = [t.strip().lstrip("{").strip() for t in lines[labels[jump.group(1)]:i + 1]]
        body = [t for t in body if t and not t.startswith(("$", "//", "}", "."))]
        mma = sum(t.startswith("mma.") for t in body)
        if mma and (best is None or len(body) > best[0]):
            best = (len(body), mma)
    if best is None:
        return "no loop with MMAs found"
    return f"step loop {best[0]} PTX instructions, {best[1]} MMAs ({best[0] / best[1]:.1f} an MMA)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nt", default="1,3,4", help="8-row activation tiles (M = 1..8, 17..24, 25..32)")
    ap.add_argument("--kw", default="4,16", help="warps a block")
    ap.add_argument("--dq", default="0,1", help="paired dequantization off / on")
    ap.add_argument("--rt", default="1", help="16-row output tiles a warp")
    ap.add_argument("--builds", default="plain", help=f"qmm_mma's fused builds, of {', '.join(BUILDS)}")
    ap.add_argument("--ptx", action="store_true", help="also the PTX instructions of the step loop")
    a = ap.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("kernel_registers needs nvcc (CUDA's compiler)")
    with tempfile.TemporaryDirectory() as tmp:
        for build in a.builds.split(","):
            settings = (a.nt, a.kw, a.dq, a.rt)
            for nt, kw, dq, rt in itertools.product(*(map(int, v.split(",")) for v in settings)):
                template = dict(OutT="bfloat16", GS=64, BITS=4, NT=nt, RT=rt, KW=kw, DQ=dq)
                report = ptxas_report(BUILDS[build], template, Path(tmp))
                if a.ptx:
                    report += "; " + ptx_step(BUILDS[build], template, Path(tmp))
                print(f"{build} NT={nt} KW={kw} DQ={dq} RT={rt}: {report}", flush=True)


if __name__ == "__main__":
    main()
