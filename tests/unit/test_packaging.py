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
