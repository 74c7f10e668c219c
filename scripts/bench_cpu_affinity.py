"""Plain decoding speed with the process pinned to each set of host CPUs, each in a fresh process.

    python scripts/bench_cpu_affinity.py [--model DIR] [--dtype bfloat16] [--sets all,nodes,gpu,each]
        [--repeat-all 4] [--tokens 128] [--runs 3] [--json OUT.json]

Why: on the H200 machine a decode step waits for the host encoding its launches (BENCHMARKS.md,
issues 12 and 13), and the same command ran at two speeds process by process (plain decoding
~157 or ~235 tok/s on the 9B-shaped pair, three runs within a process agreeing), as if it
depended on where the process landed. This runs the same greedy decode under CPU sets:
- `all`: no pinning (`--repeat-all` processes), each reporting the CPU its main thread ended on;
- `nodes`: each NUMA node's CPUs (/sys/devices/system/node);
- `gpu`: the CPUs the driver lists as local to the GPU's PCI slot (local_cpulist);
- `each`: every allowed CPU alone.
Pinning is os.sched_setaffinity before MLX is imported, so every thread MLX starts inherits it.
Prints per set the median decode tok/s and its runs; a set that is consistently fast where `all`
is bimodal says the placement is the cause.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from cpu_topology import gpu_local_cpus, numa_nodes, parse_cpulist  # noqa: E402

BUNDLED = Path(__file__).resolve().parents[1] / "engine" / "bundled" / "target"


def last_cpu() -> int:
    """The CPU this thread last ran on (field 39 of /proc/self/stat)."""
    stat = Path("/proc/thread-self/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[36])


def worker(a: argparse.Namespace) -> None:
    if a.cpus:
        os.sched_setaffinity(0, parse_cpulist(a.cpus))
    from bench_cuda_graphs import timed_generations  # imports MLX: after the pinning

    result = timed_generations(a.model, a.dtype, None, "none", a.tokens, a.runs, ignore_eos=True)
    print(json.dumps({"tps": result["none"]["tps"], "cpu": last_cpu(), "device": result["_device"]["device"]}))


def cpu_sets(kinds: list[str], repeat_all: int) -> list[tuple[str, str]]:
    """-> [(label, cpulist or "" for no pinning)] in the order they run."""
    allowed = sorted(os.sched_getaffinity(0))
    out: list[tuple[str, str]] = []
    for kind in kinds:
        if kind == "all":
            out += [("all", "")] * repeat_all
        elif kind == "nodes":
            out += [(f"node{n}", ",".join(map(str, cpus))) for n, cpus in numa_nodes().items()
                    if set(cpus) & set(allowed)]
        elif kind == "gpu":
            local = gpu_local_cpus()
            if local:
                out.append(("gpu-local", ",".join(str(c) for c in local if c in allowed)))
        elif kind == "each":
            out += [(f"cpu{c}", str(c)) for c in allowed]
        else:
            raise SystemExit(f"unknown set kind {kind!r}: all, nodes, gpu or each")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sets", default="all,nodes,gpu,each")
    ap.add_argument("--repeat-all", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cpus", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    print(f"allowed CPUs {sorted(os.sched_getaffinity(0))}; NUMA nodes {numa_nodes()}; "
          f"GPU-local {gpu_local_cpus()}", flush=True)
    rows = []
    for label, cpus in cpu_sets(a.sets.split(","), a.repeat_all):
        argv = [sys.executable, __file__, "--worker", "--model", a.model, "--dtype", a.dtype, "--tokens",
                str(a.tokens), "--runs", str(a.runs), "--cpus", cpus]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"{label}: over {a.timeout:.0f} s", flush=True)
            continue
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            print(f"{label}: rc {p.returncode}: {p.stderr.strip()[-300:]}", flush=True)
            continue
        r = json.loads(lines[-1])
        rows.append({"set": label, "cpus": cpus, **r})
        print(f"{label:10} ({time.perf_counter() - t0:4.0f} s) median {statistics.median(r['tps']):7.1f} tok/s  "
              f"runs {[round(x) for x in r['tps']]}  ended on cpu {r['cpu']}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
