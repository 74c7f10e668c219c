"""Where the host's CPUs sit relative to the GPU (Linux sysfs): NUMA nodes and the CPUs local to
the GPU's PCI slot, for scripts/bench_cpu_affinity.py. No MLX here, so no BLAS preload needed."""

from __future__ import annotations

import os
from pathlib import Path

SYS = Path("/sys")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def parse_cpulist(text: str) -> list[int]:
    """Linux's cpulist format: "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def numa_nodes(sys_root: Path = SYS) -> dict[int, list[int]]:
    """-> {node: its CPUs}; empty where sysfs has no NUMA information."""
    out = {}
    for d in sorted((sys_root / "devices/system/node").glob("node[0-9]*")):
        cpulist = d / "cpulist"
        if cpulist.exists():
            out[int(d.name[4:])] = parse_cpulist(cpulist.read_text())
    return out


def cuda_pci_ids(proc_gpus: Path = NVIDIA_GPUS) -> list[str]:
    """The NVIDIA GPUs' PCI addresses, in bus order (CUDA's order for identical GPUs)."""
    return sorted(p.name.lower() for p in proc_gpus.glob("*")) if proc_gpus.is_dir() else []


def gpu_local_cpus(index: int | None = None, sys_root: Path = SYS, proc_gpus: Path = NVIDIA_GPUS) -> list[int]:
    """The CPUs local to the CUDA device the process uses (the first visible one unless `index`),
    from its PCI slot's local_cpulist; [] where that is not known (no NVIDIA driver, a visible
    device given by UUID, no sysfs)."""
    ids = cuda_pci_ids(proc_gpus)
    if index is None:
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        if not first.isdigit():
            return []
        index = int(first)
    if not 0 <= index < len(ids):
        return []
    cpulist = sys_root / "bus/pci/devices" / ids[index] / "local_cpulist"
    return parse_cpulist(cpulist.read_text()) if cpulist.exists() else []
