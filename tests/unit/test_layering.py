"""The three floors: scripts may import server and engine, server never imports MLX, engine never
imports the server or web frameworks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WEB = ("fastapi", "starlette", "uvicorn", "sse_starlette", "pydantic", "httpx", "jinja2")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("path", sorted((REPO / "server").rglob("*.py")), ids=lambda p: p.name)
def test_server_never_imports_mlx(path):
    assert not {m for m in imported_modules(path) if top(m) == "mlx"}


@pytest.mark.parametrize("path", sorted((REPO / "engine").rglob("*.py")), ids=lambda p: p.name)
def test_engine_never_imports_the_floors_above(path):
    bad = {m for m in imported_modules(path) if top(m) in ("server", "scripts", "tests", *WEB)}
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
