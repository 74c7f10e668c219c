"""scripts/cpu_topology.py reads sysfs: checked against a fake tree laid out like Linux's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from cpu_topology import cuda_pci_ids, gpu_local_cpus, numa_nodes, parse_cpulist  # noqa: E402


@pytest.mark.parametrize("text, cpus", [("0-3,8,10-11\n", [0, 1, 2, 3, 8, 10, 11]), ("5", [5]), ("", []),
                                        ("0-1, 4", [0, 1, 4])])
def test_parse_cpulist(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text) == cpus


def fake_host(root: Path) -> tuple[Path, Path]:
    """Two NUMA nodes of 4 CPUs and two GPUs, one on each node."""
    sys_root, proc = root / "sys", root / "proc"
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        d = sys_root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    (sys_root / "devices/system/node/possible").write_text("0-1\n")  # not a node directory
    for bus, cpus in (("0000:9a:00.0", "4-7"), ("0000:19:00.0", "0-3")):
        (proc / bus.upper()).mkdir(parents=True)
        d = sys_root / "bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "local_cpulist").write_text(cpus + "\n")
    return sys_root, proc


def test_nodes_and_gpus_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys_root, proc = fake_host(tmp_path)
    assert numa_nodes(sys_root) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert cuda_pci_ids(proc) == ["0000:19:00.0", "0000:9a:00.0"]  # bus order, lower case as sysfs
    assert gpu_local_cpus(1, sys_root, proc) == [4, 5, 6, 7]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_local_cpus(None, sys_root, proc) == [0, 1, 2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert gpu_local_cpus(None, sys_root, proc) == [4, 5, 6, 7]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2a")  # a UUID: which slot is not known
    assert gpu_local_cpus(None, sys_root, proc) == []
    assert gpu_local_cpus(2, sys_root, proc) == []


def test_no_driver_no_numa(tmp_path: Path) -> None:
    assert numa_nodes(tmp_path) == {}
    assert cuda_pci_ids(tmp_path / "absent") == []
    assert gpu_local_cpus(0, tmp_path, tmp_path / "absent") == []
