"""pyproject lists its packages (configs/ ships as engine/configs); a package left out of the list
would be missing from the wheel without any error."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def test_every_package_is_listed():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for top in ("engine", "server")
             for p in (REPO / top).rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert setuptools["package-dir"]["engine.configs"] == "configs"
    assert any((REPO / "configs").glob("*.toml"))


def test_every_native_source_ships():
    """The C and C++ files the engine compiles on first use (the shims, the extensions) are package
    data: without one a wheel install builds nothing and falls back without a word."""
    data = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["engine"])
    sources = {p.name for pattern in ("*.c", "*.cpp") for p in (REPO / "engine").glob(pattern)}
    assert sources and sources <= data, f"add to [tool.setuptools.package-data] engine: {sorted(sources - data)}"
