"""--dtype auto: bfloat16 on a GPU (Metal or CUDA), float32 on the CPU; other names pass checked."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.config import EngineConfig
from engine.dtypes import resolve_dtype


def test_auto_follows_the_device():
    assert resolve_dtype("auto", mx.Device(mx.DeviceType.gpu, 0)) == "bfloat16"
    assert resolve_dtype("auto", mx.Device(mx.DeviceType.cpu, 0)) == "float32"
    assert resolve_dtype("auto") == ("bfloat16" if mx.default_device().type == mx.DeviceType.gpu else "float32")


def test_explicit_names_and_errors():
    for name in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(name, mx.Device(mx.DeviceType.gpu, 0)) == name
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        resolve_dtype("int8")
    assert EngineConfig(model_path="x").dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model_path="x", dtype="fp8")


def test_the_kv_dtype_flag_reaches_the_engine_config(tiny_qwen35):
    """--kv-dtype: auto unless given; a name it does not know is refused by the parser (exit 2,
    the choices named) and by EngineConfig itself."""
    from engine.config import EngineConfig
    from server.cli import build_parser
    from server.cli_settings import engine_settings

    parser = build_parser()
    run = ["run", "--model", str(tiny_qwen35), "-m", "hi"]
    assert engine_settings(parser.parse_args(run)).config.kv_dtype == "auto"
    assert engine_settings(parser.parse_args([*run, "--kv-dtype", "float16"])).config.kv_dtype == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args([*run, "--kv-dtype", "int8"])
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        EngineConfig(model_path=str(tiny_qwen35), kv_dtype="int8")
