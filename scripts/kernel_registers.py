"""Registers, spills and shared memory of qmm_mma's builds, as nvcc's assembler reports them.

    python scripts/kernel_registers.py [--nt 1,3,4] [--kw 4,16] [--dq 0,1] [--rt 1] [--pf 1,2]
                                       [--builds plain,norm,res,swiglu,swiglu-res]

Where nvcc is (the GPU machine). Renders the exact text MLX hands NVRTC (tests/kernels/render.py)
for each template and compiles it for sm_90 with `-Xptxas -v`: a build that spills or needs more
registers than its block size allows explains a slow configuration before any timing does.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nt", default="1,3,4", help="8-row activation tiles (M = 1..8, 17..24, 25..32)")
    ap.add_argument("--kw", default="4,16", help="warps a block")
    ap.add_argument("--dq", default="0,1", help="paired dequantization off / on")
    ap.add_argument("--pf", default="1", help="steps of weights loaded ahead (PF)")
    ap.add_argument("--rt", default="1", help="16-row output tiles a warp")
    ap.add_argument("--builds", default="plain", help=f"qmm_mma's fused builds, of {', '.join(BUILDS)}")
    a = ap.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("kernel_registers needs nvcc (CUDA's compiler)")
    with tempfile.TemporaryDirectory() as tmp:
        for build in a.builds.split(","):
            settings = (a.nt, a.kw, a.dq, a.rt, a.pf)
            for nt, kw, dq, rt, pf in itertools.product(*(map(int, v.split(",")) for v in settings)):
                template = dict(OutT="bfloat16", GS=64, BITS=4, NT=nt, RT=rt, KW=kw, DQ=dq, PF=pf)
                report = ptxas_report(BUILDS[build], template, Path(tmp))
                print(f"{build} NT={nt} KW={kw} DQ={dq} RT={rt} PF={pf}: {report}", flush=True)


if __name__ == "__main__":
    main()
