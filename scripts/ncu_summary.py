"""Kernel counts and GPU time per forward pass, from ncu's CSV of scripts/profile_gpu.py --ncu.

    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \\
        python scripts/profile_gpu.py --out DIR --shape 9b --layers 32 --rows 1,17 --ncu > step.csv
    python scripts/ncu_summary.py step.csv [--top 12]

profile_gpu.py --ncu captures one verify per row count, one after the other; ncu's CSV does not
mark where one ends, so a pass is taken to start where the first pass's first three kernel names
recur (each begins with the embedding lookup). Per pass: the number of kernels, their summed
durations (with and without the pass's first kernel, which ncu has timed cold: 0.2-0.35 ms where
the same kernel takes ~5 us elsewhere), and the kernels that take the most time, by name.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
from pathlib import Path

UNITS_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def kernels(path: Path) -> list[tuple[str, float]]:
    """(short kernel name, µs) in launch order."""
    rows = [r for r in csv.reader(path.open()) if len(r) > 10]
    header, data = rows[0], rows[1:]
    name, value, unit = (header.index(k) for k in ("Kernel Name", "Metric Value", "Metric Unit"))
    return [(re.sub(r"\(.*", "", r[name]).removeprefix("mlx::custom_kernel_").removeprefix("void ")[:90],
             float(r[value].replace(",", "")) * UNITS_US[r[unit]]) for r in data]


def passes(launches: list[tuple[str, float]]) -> list[list[tuple[str, float]]]:
    head = [n for n, _ in launches[:3]]
    starts = [0] + [i for i in range(3, len(launches) - 2) if [n for n, _ in launches[i : i + 3]] == head]
    return [launches[a:b] for a, b in zip(starts, [*starts[1:], len(launches)], strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    for i, part in enumerate(passes(kernels(a.csv))):
        total = sum(us for _, us in part)
        print(f"pass {i + 1}: {len(part)} kernels, {total / 1e3:.3f} ms "
              f"({(total - part[0][1]) / 1e3:.3f} ms without its first kernel, {part[0][1]:.1f} us)")
        by_name: dict[str, list[float]] = collections.defaultdict(list)
        for n, us in part:
            by_name[n].append(us)
        for n, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[: a.top]:
            print(f"  {sum(times):9.1f} us  {len(times):4d} x {sum(times) / len(times):7.1f} us  {n}")


if __name__ == "__main__":
    main()
