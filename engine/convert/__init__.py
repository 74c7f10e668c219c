"""`spruce convert`: an HF checkpoint -> MLX layout, affine 4/8-bit, optionally Hadamard-rotated.

source.py reads the checkpoint's files and headers, rules.py decides what happens to each tensor
(layout conventions, rotation, quantization), writer.py writes the output shards, run.py drives the
conversion one source file at a time. The math of the rotation is in docs/hadamard.md.
"""

from engine.convert.rules import ConvertOptions
from engine.convert.run import ConvertError, ConvertReport, convert

__all__ = ["ConvertError", "ConvertOptions", "ConvertReport", "convert"]
