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
    """--kv-dtype: auto unless given (int8 among the names); a name it does not know is refused by
    the parser (exit 2, the choices named) and by EngineConfig itself."""
    from engine.config import EngineConfig
    from server.cli import build_parser
    from server.cli_settings import engine_settings

    parser = build_parser()
    run = ["run", "--model", str(tiny_qwen35), "-m", "hi"]
    assert engine_settings(parser.parse_args(run)).config.kv_dtype == "auto"
    assert engine_settings(parser.parse_args([*run, "--kv-dtype", "float16"])).config.kv_dtype == "float16"
    assert engine_settings(parser.parse_args([*run, "--kv-dtype", "int8"])).config.kv_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args([*run, "--kv-dtype", "int4"])
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        EngineConfig(model_path=str(tiny_qwen35), kv_dtype="int4")


def test_kv_auto_halves_a_16_bit_checkpoint_on_the_cpu_only():
    """--kv-dtype auto: float16 where a 16-bit checkpoint computes in float32 on the CPU (its decode
    step reads the K/V cache whole); the compute dtype everywhere else; named dtypes as given."""
    from engine.dtypes import resolve_kv_dtype

    cpu, gpu = mx.Device(mx.DeviceType.cpu, 0), mx.Device(mx.DeviceType.gpu, 0)
    assert resolve_kv_dtype("auto", "float32", "bfloat16", cpu) == "float16"
    assert resolve_kv_dtype("auto", "float32", "float16", cpu) == "float16"
    assert resolve_kv_dtype("auto", "float32", "float32", cpu) == "float32"  # a float32 checkpoint stays exact
    assert resolve_kv_dtype("auto", "float32", None, cpu) == "float32"
    assert resolve_kv_dtype("auto", "bfloat16", "bfloat16", cpu) == "bfloat16"
    assert resolve_kv_dtype("auto", "float32", "bfloat16", gpu) == "float32"  # only the CPU reads halves in place
    assert resolve_kv_dtype("auto", "bfloat16", "bfloat16", gpu) == "bfloat16"
    for name in ("float32", "float16", "bfloat16", "int8"):
        assert resolve_kv_dtype(name, "float32", "bfloat16", cpu) == name
    with pytest.raises(ValueError, match="int8 is for the CPU backend"):  # read in place only there
        resolve_kv_dtype("int8", "bfloat16", "bfloat16", gpu)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        resolve_kv_dtype("int4", "float32", None, cpu)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's auto rule")
def test_the_engine_stores_a_16_bit_checkpoints_kv_as_float16(tmp_path_factory, tiny_qwen35):
    """The loader reports the checkpoint's stored float dtype, and the engine's auto K/V follows it:
    a float32 checkpoint keeps its K/V as computed (the tests' identity demands), a float16 one
    (bfloat16 takes transformers to write) stores float16 rows; `kv_dtype="float32"` keeps them full width."""
    from engine.cache import KVCache
    from engine.generate import Engine
    from tests.helpers import checkpoint_maker

    half = tmp_path_factory.mktemp("tiny_qwen35_f16")
    checkpoint_maker().main([str(half), "--kind", "qwen3_5", "--dtype", "float16"])
    exact = Engine(EngineConfig(model_path=str(tiny_qwen35)))
    assert exact.kv_dtype is None
    engine = Engine(EngineConfig(model_path=str(half)))
    assert engine.dtype == "float32" and engine.kv_dtype == mx.float16
    assert all(c.dtype == mx.float16 for c in engine.make_cache() if isinstance(c, KVCache))
    assert Engine(EngineConfig(model_path=str(half), kv_dtype="float32")).kv_dtype is None
