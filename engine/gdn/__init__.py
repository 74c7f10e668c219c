"""Gated DeltaNet (GDN): the recurrent half of Qwen3.5's hybrid layers.

Conventions shared by every module here (batch 1 squeezed, docs/gdn_tree.md has the derivations):
  q, k  [N, Hv, Dk]  L2-normalised, q also scaled by Dk^-1/2, already repeated from Hk to Hv heads
  v     [N, Hv, Dv]
  g     [N, Hv]      log-decay (<= 0);  beta [N, Hv] already sigmoided
  S     [Hv, Dv, Dk] recurrent state, float32, element (v, k) as mlx-lm and uzu store it
One step:  S = exp(g) S;  u = beta (v - S k);  S = S + u k^T;  o = S q.
u is the step's *innovation*: a tree verify keeps every node's u, and the commit folds the accepted
path's innovations into the committed state without solving anything again.

- `ops`: the math in plain MLX ops (the twins every kernel is tested against; they run on the CPU).
- `triangular`: the unit-lower-triangular solve of the dense forms, accurate on every backend.
- `core`: the interface the layer calls (one-token step, chain, tree verify, commit) and its
  plain-ops implementation; kernel implementations live in engine/kernels.py.
- `reference`: per-token and per-node loops, the slow obvious twins used by tests and benchmarks.
"""
