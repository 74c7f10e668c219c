"""Spruce engine: token ids and tensors, owned by one thread. Never imports fastapi."""

from engine.precision import full_float32

# before anything imports mlx and runs a product: float32 products stay float32 on GPUs with
# matrix units, so a verify row computes what the one-row step does (engine/precision.py)
full_float32()
