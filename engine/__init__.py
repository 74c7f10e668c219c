"""Spruce engine: token ids and tensors, owned by one thread. Never imports fastapi."""
