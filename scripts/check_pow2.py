"""Whether the shim's powf(2, y) as exp2f(y) (engine/exp2_shim.c) gives glibc's powf bits for every
float32 y, and what each costs an element through MLX's `power`.

    python scripts/check_pow2.py [--step 1] [--chunk 16777216]

Walks the float32 bit patterns (every `--step`th; 1 = all 2^32) in chunks, evaluating
mx.power(2, y) with the shim's fast path off (libm's powf) and on, and counts the elements whose
bits differ (NaNs count as equal to NaNs). The shim checks a sample at load; this is the whole
range, for a libm the sample may not speak for. Needs the shim (Linux, a C compiler) and takes
about a minute for all 2^32 on the dev CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine import blas  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=int, default=1, help="check every step-th bit pattern")
    ap.add_argument("--chunk", type=int, default=1 << 24, help="elements a chunk")
    a = ap.parse_args()
    if blas.POW2.value is None:
        sys.exit("check_pow2: the shim is not loaded here (Linux with OpenBLAS and a C compiler)")
    print(f"load-time check: {blas.POW2_CHECKED.value} (1 passed, -1 failed: the fast path stays off)")
    mx.set_default_device(mx.cpu)
    differ = checked = 0
    seconds = {0: 0.0, 1: 0.0}
    span = a.chunk * a.step
    for start in range(0, 1 << 32, span):
        bits = np.arange(start, min(start + span, 1 << 32), a.step, dtype=np.uint64).astype(np.uint32)
        y = mx.array(bits.view(np.float32))
        mx.eval(y)
        out = {}
        for mode in (0, 1):
            blas.POW2.value = mode
            t = time.perf_counter()
            out[mode] = mx.power(2.0, y)
            mx.eval(out[mode])
            seconds[mode] += time.perf_counter() - t
        slow, fast = np.array(out[0]), np.array(out[1])
        same = (slow.view(np.uint32) == fast.view(np.uint32)) | (np.isnan(slow) & np.isnan(fast))
        differ += int((~same).sum())
        checked += len(bits)
        if not same.all():
            first = bits[~same][0].view(np.float32)
            print(f"  differs at y = {float(first)!r}: powf {float(slow[~same][0])!r}, exp2f {float(fast[~same][0])!r}")
    blas.POW2.value = 1
    print(f"{checked} exponents, {differ} differ; ns an element through mx.power: libm's powf "
          f"{seconds[0] / checked * 1e9:.2f}, exp2f {seconds[1] / checked * 1e9:.2f}")


if __name__ == "__main__":
    main()
