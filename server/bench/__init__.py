"""`spruce bench`: measure any OpenAI-compatible server the way its users would compare servers.

prompts (the prompt set) -> client (one timed streamed request) -> runner (warm-up + measured runs
per prompt) -> stats (per-class summary) -> records (JSON) / report (markdown) / plots (PNG).
HTTP only: nothing here imports mlx or the engine.
"""
