"""Picks the implementation of the GDN recurrent core for the backend MLX runs on.

On the CPU the plain-MLX core runs (engine/gdn/core.py, OpsCore). GPU kernels plug in here as
further GDNCore implementations.
"""

from __future__ import annotations

from engine.gdn.core import GDNCore, OpsCore


def select_gdn_core() -> GDNCore:
    return OpsCore()
