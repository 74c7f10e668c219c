"""Every CPU benchmark re-execs itself with OpenBLAS before MLX loads.

MLX's Linux CPU wheel ships a reference BLAS that makes an n-row matmul ~n times a one-row one, so a
benchmark without the preload times a different engine: tree verifies 5-15x slower than with the
preload, the exact cost speculation is judged by. Issue 17's MTP rows were once measured that
way (bench_context.py had no preload), and the stall they showed was the BLAS, not the engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# scripts that never run MLX on the CPU, or are modules other scripts import
EXEMPT = {
    "bench_gpu.py": "GPU only (random-weight checkpoints of real shapes)",
    "profile_gpu.py": "GPU only",
    "bench_kernel_call.py": "GPU only (custom-kernel calls)",
    "bench_health.py": "drives `spruce serve`, which re-execs itself",
    "peer_engines.py": "a module of bench_peers.py, which starts servers that re-exec themselves",
    "shaped_checkpoint.py": "writes checkpoints for the GPU benchmarks",
    "widen_checkpoint.py": "writes checkpoints (random fills and scatters, no matmul)",
    "round_costs.py": "a module of the GPU benchmarks (its importers re-exec)",
    "variants.py": "a module of the benchmarks (their variant suffixes; its importers re-exec)",
    "kernel_registers.py": "GPU machine only (nvcc); imports MLX for names, runs no MLX op",
    "draft_vocab.py": "tokenizes a corpus and counts tokens; runs no MLX op",
}


def _uses_mlx(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in ("mlx", "engine") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("mlx", "engine"):
            return True
    return False


def _first_mlx_import(tree: ast.Module) -> int | None:
    """Line of the first top-level import that can load mlx (engine.blas never does)."""
    for node in tree.body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        if any(n.split(".")[0] in ("mlx", "engine") and n != "engine.blas" or n.startswith("bench_") for n in names):
            return node.lineno
    return None


def _reexec_line(tree: ast.Module) -> int | None:
    """Line of a top-level `if __name__ == "__main__": reexec_with_openblas(...)`."""
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and ast.unparse(call.func) == "reexec_with_openblas":
                    return node.lineno
    return None


CANDIDATES = sorted(p for p in SCRIPTS.glob("*.py") if p.name not in EXEMPT)


@pytest.mark.parametrize("script", CANDIDATES, ids=lambda p: p.name)
def test_script_preloads_openblas_before_mlx(script: Path) -> None:
    tree = ast.parse(script.read_text())
    if not _uses_mlx(tree):
        return
    reexec = _reexec_line(tree)
    assert reexec is not None, f"{script.name} runs MLX but never calls reexec_with_openblas"
    first = _first_mlx_import(tree)
    assert first is None or reexec < first, (
        f"{script.name}: line {first} may import mlx before the re-exec at line {reexec}")


def test_the_check_sees_a_script_without_the_preload() -> None:
    bad = ast.parse("import sys\nimport mlx.core as mx\n")
    late = ast.parse("import mlx.core as mx\nfrom engine.blas import reexec_with_openblas\n"
                     "if __name__ == '__main__':\n    reexec_with_openblas([])\n")
    assert _uses_mlx(bad) and _reexec_line(bad) is None
    assert _first_mlx_import(late) == 1 and _reexec_line(late) == 3


CONFTESTS = sorted((SCRIPTS.parent / "tests").rglob("conftest.py"))


@pytest.mark.parametrize("conftest", CONFTESTS, ids=lambda p: str(p.relative_to(SCRIPTS.parent)))
def test_conftests_leave_mlx_unimported(conftest: Path) -> None:
    """The test run re-execs itself with OpenBLAS and the engine's shim in tests/conftest.py's
    pytest_configure, which does nothing once mlx is imported; pytest imports the conftest.py of
    every path it is given before that, so none may import mlx (tests/server/conftest.py did, and
    `python -m pytest tests/server` ran on the slow bundled BLAS)."""
    import subprocess
    import sys

    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('probe_conftest', {str(conftest)!r})\n"
            "module = sys.modules['probe_conftest'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "print('mlx.core' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=SCRIPTS.parent)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "False"
