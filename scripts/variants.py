"""The engine settings a benchmark variant names, one "-" suffix each (scripts/bench_gpu.py's
`--cores`, scripts/profile_rounds.py's `--variants`), set around each of its engine's calls:

- "-kwN": qmm_mma's long reductions with N warps a block (engine.qmm.MMA_LONG_KW);
- "-ksN": its weights of few output tiles with N warps a block (engine.qmm.MMA_FEW_KW, default 8);
- "-ktN": "few" meaning at most N tiles of 16 output rows (engine.qmm.MMA_FEW_TILES, default 256);
- "-dq0" / "-dq1": its paired dequantization off / on (engine.qmm.MMA_PAIRED_DEQUANT);
- "-evN": a multi-node verify handed to the device every N layers whatever the model's layer size
  (engine.forward.VERIFY_EVAL_EVERY; 0 = at the end);
- "-fold0" / "-fold1": each commit on its own / folded into the next verify (GDNCache.fold_commits);
- "-sd0" / "-sd1": the MTP head drafting depth by depth on a GPU or not
  (engine.drafters.mtp.SYNC_EACH_DEPTH_ON_GPU);
- "-cd0" / "-cd1": chains of top-1s drafted on the device, the verify queued behind them, or not
  (engine.round.CHAIN_ON_DEVICE);
- "-at0" / "-at1": the attention kernels off / on (engine.attention_rows.SWITCH);
- "-ad0" / "-ad1": the MTP head's drafted row through its attention kernel or its ops
  (engine.attention_rows.DRAFT_SWITCH; read when the head's step traces);
- "-an0" / "-an1": each layer's residual add fused with its norm (engine.fused_norms.ADD);
- "-gn0" / "-gn1": the GDN output's norm fused with its gate (engine.fused_norms.GATED);
- "-gs0" / "-gs1": where that gated norm's kernel runs after a token's GDN step, the two in two
  launches / in one (engine.kernels.GATED_STEP, opt-in; part of a layer's trace key);
- "-gwN": that one launch with N SIMD groups a head (engine.kernels.GATED_STEP_WARPS, default 16);
- "-qf0" / "-qf1": the quantized projections fused with the norms before them and the residual
  adds after them (engine.models.fused_qmm.SWITCH);
- "-qr0" / "-qr1": the residual adds alone fused with the projections before them
  (engine.models.fused_qmm.RES);
- "-pg0" / "-pg1": the CPU's sigmoid and SiLU through MLX's own functions / through 2^
  (engine.cpu_exp.POW_GATES);
- "-pw0" / "-pw1": libm's powf(2, y) left to libm / answered by exp2f(y) (engine.blas.POW2, the
  shim's engine/exp2_shim.c; the same bits either way, a no-op without the shim);
- "-hw0" / "-hw1": products by registered weights from the float32 weights / from their bfloat16
  copies (engine.blas.HALF, engine/half_weights.py; the same bits either way, a no-op without the
  shim);
- "-ca0" / "-ca1": a decode step's and a verify's attention on the CPU in MLX's operations / in
  the engine's own operation (engine.cpu_ext.ATTENTION, engine/cpu_ext.cpp; a no-op where it is
  not built);
- "-cg0" / "-cg1": a GDN layer's token step on the CPU in MLX's operations / in the engine's own
  operation (engine.cpu_ext.GDN_STEP, engine/cpu_ext.cpp; part of a layer's trace key);
- "-ct0" / "-ct1": a GDN layer's tree verify and commit on the CPU in MLX's operations (the dense
  form) / in the engine's own operations (engine.cpu_ext.GDN_TREE; part of a layer's trace key;
  the commit's switch is read when it runs);
- "-cc0" / "-cc1": a prefill's chain through a GDN layer's core on the CPU in MLX's operations (the
  chunked dense form) / in the engine's own operation, token by token (engine.cpu_ext.GDN_CHAIN;
  read per call);
- "-cn0" / "-cn1": RMS norms on the CPU through mx.fast.rms_norm / the engine's own operation
  (engine.cpu_ext.NORMS; part of a layer's trace key);
- "-cf0" / "-cf1": a decode step's and a verify's MLP block (residual add, norm, MLP, add) on the
  CPU in MLX's operations / in one operation of the engine's own (engine.cpu_ext.MLP; part of a
  layer's trace key);
- "-cp0" / "-cp1": a mixer's input norm and projections on the CPU in MLX's operations / in one
  operation of the engine's own (engine.cpu_ext.PRODUCTS; part of a layer's trace key);
- "-cr0" / "-cr1": RoPE on the CPU through MLX's rope (compiled) / the engine's own operation
  (engine.cpu_ext.ROPE; read per call);
- "-cm0" / "-cm1": an MTP chain draft on the CPU depth by depth in MLX's operations / in one
  operation of the engine's own (engine.cpu_ext.MTP_CHAIN, read per draft);
- "-cs0" / "-cs1": the sampler's choice and the target's top-token probability on the CPU in MLX's
  operations / in one operation of the engine's own (engine.cpu_ext.CHOOSE, read per call);
- "-cw0" / "-cw1": a top-k draw on the CPU computing 2^y of every logit / only of those that can
  reach the k-th largest (engine.cpu_ext.NARROW_TOP_K);
- "-dn0" / "-dn1": a visited node of a sampled tree on the CPU drawn in a graph of its own / at once
  on the host, and a tree's accepted rows' top-token probability in NumPy / at once in the CPU's
  own operation (engine.cpu_ext.DRAW_NOW);
- "-kh0" / "-kh1": a half K/V cache's attention scores on the CPU loading each key row once a query
  head / once for all the query heads of its K/V head (engine.cpu_ext.KV_HEADS_TOGETHER, read per
  call; the same bits);
- "-cx0" / "-cx1": a softmax over float32 rows on the CPU (attention in operations: a DFlash block's,
  a prefill chunk's) in MLX's operations / in the engine's own operation (engine.cpu_ext.SOFTMAX;
  read per call, and by the DFlash block's trace);
- "-cq0" / "-cq1": a prefill chunk's attention on the CPU (float32) in MLX's operations or its fused
  kernel / in the engine's own operation, tiles of keys with a running softmax
  (engine.cpu_ext.CAUSAL, read per call);
- "-lp0" / "-lp1": a decode step's GDN layers as one launch plan each and its attention layers as
  two, with the wiring the plans record for every pass (engine.launch_plan.SWITCH; CUDA with the
  engine's extension built);
- "-ap0" / "-ap1": with the launch plans on, the attention layers left in the wiring before them /
  as their two plans (engine.layer_plans.ATTENTION; opt-in);
- "-acN": the GPU attention kernel of decode and verify rows walking chunks of N keys a SIMD group
  (engine.attention_rows.ATTN_CHUNK, default 32; read per call);
- "-akN": that kernel loading N keys of a chunk together before their softmax updates
  (engine.attention_rows.ATTN_KEYS, default 8; read per call; the same bits whatever N is);
- "-amN": its merge loading N chunks together (engine.attention_rows.MERGE_CHUNKS, default 1; read
  per call; the same bits whatever N is);
- "-agN": its merge shared by N SIMD groups a (row, head) on CUDA past MERGE_SPAN chunks a row
  (engine.attention_rows.MERGE_GROUPS, default 8; read per call; other bits for N > 1, the same for
  a verify row and the decode step);
- "-ht0" / "-ht1": the weaker evidence classes' tree-size controllers try trees blind / only where
  the drafter's hindsight says they would go deep (engine.spec_evidence.WEAK_WAIT; read when a
  request's controllers are made);
- "-gh0" / "-gh1": the target's K/V and feature buffers grow KV_STEP rows at a time / by a share of
  the context (engine.cache.HEADROOM; read at each growth)
- "-srN": products of up to N rows through the GEMV shim's small-row path on the CPU, 0 = none
  (engine.blas.SMALL_ROWS; a no-op without the shim);
- "-stN": that path on at most N threads, 0 = every core (engine.blas.GEMM_THREADS);
- "-sl0" / "-sl1": a pipelined round on the CPU with a drafter on started at once / once the round
  before has landed (engine.round.START_LATE_ON_CPU);
- "-saN": that round's first N layers handed over before the round before lands
  (engine.round.START_AHEAD_LAYERS);
- "-rpN": N layers more handed over early from one such round to the next, 0 = none
  (engine.round.AHEAD_RAMP);
- "-ra0" / "-ra1": the plain round right after a tree pipelined or landed alone on the CPU
  (engine.round.RESTART_ALONE_ON_CPU);
- "-dv0" / "-dv1": a sampled tree's nodes on the CPU all drawn in the verify's graph / each drawn
  as the accept walk visits it (engine.round.DRAW_VISITED_ON_CPU);
- "-ck0" / "-ck1": the sampler's choice on CUDA in MLX's operations / in one launch of its kernel
  (engine.choose_kernel.KERNEL);
- "-cu0" / "-cu1": an MTP chain on the CPU guessing each depth's token by its argmax / by a draw at
  the uniform the target's draw will use, where the target samples (engine.drafters.mtp.COUPLED_DRAWS);
- "-mpN": the MTP draft's stop rule at a top-1 path probability of N / 100, 0 = none
  (engine.drafters.mtp.MIN_PATH_PROB, default 0.3);
- "-skN": the MTP head caught up by rounds without its tree from N rows behind on, 0 = only at the
  next propose (engine.drafters.mtp.SKIP_CATCH_UP, default 32);
- "-sg0" / "-sg1": a one-token pass layer by layer / in compiled segments between the attention
  layers' cache accesses (engine.models.segments.SEGMENTS).

Other suffixes are left to the caller (bench_gpu's "-mlxqmm", profile_rounds' own probes).
Compiled layer graphs are per model instance and trace on first use, so each engine's graphs carry
the settings they were traced with (the fused norms are part of a layer's trace key, so they switch
within one engine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


def _settings() -> dict[str, tuple[list[tuple[Any, str]], Callable[[str], tuple[Any, ...]]]]:
    """suffix prefix -> (the (owner, attribute) pairs it sets, the values from the suffix's rest)."""
    from engine import (
        attention_rows,
        blas,
        cache,
        choose_kernel,
        cpu_exp,
        cpu_ext,
        forward,
        fused_norms,
        kernels,
        launch_plan,
        layer_plans,
        qmm,
        spec_evidence,
    )
    from engine import round as rounds
    from engine.cache import GDNCache
    from engine.drafters import mtp
    from engine.models import fused_qmm, segments

    def on(rest: str) -> tuple[bool]:
        return (rest == "1",)

    return {
        "kw": ([(qmm, "MMA_LONG_KW")], lambda rest: (int(rest),)),
        "dq": ([(qmm, "MMA_PAIRED_DEQUANT")], on),
        "ev": ([(forward, "VERIFY_EVAL_EVERY"), (forward, "VERIFY_EVAL_MIN_LAYER_BYTES")], lambda rest: (int(rest), 0)),
        "fold": ([(GDNCache, "fold_commits")], on),
        "sd": ([(mtp, "SYNC_EACH_DEPTH_ON_GPU")], on),
        "cd": ([(rounds, "CHAIN_ON_DEVICE")], on),
        "at": ([(attention_rows.SWITCH, "value")], on),
        "ad": ([(attention_rows.DRAFT_SWITCH, "value")], on),
        "an": ([(fused_norms.ADD, "value")], on),
        "gn": ([(fused_norms.GATED, "value")], on),
        "gs": ([(kernels.GATED_STEP, "value")], on),
        "gw": ([(kernels, "GATED_STEP_WARPS")], lambda rest: (int(rest),)),
        "qf": ([(fused_qmm.SWITCH, "value")], on),
        "qr": ([(fused_qmm.RES, "value")], on),
        "pg": ([(cpu_exp, "POW_GATES")], on),
        "pw": ([(blas.POW2, "value")], lambda rest: (int(rest),)),
        "hw": ([(blas.HALF, "value")], lambda rest: (int(rest),)),
        "ca": ([(cpu_ext, "ATTENTION")], on),
        "cg": ([(cpu_ext, "GDN_STEP")], on),
        "ct": ([(cpu_ext, "GDN_TREE")], on),
        "cc": ([(cpu_ext, "GDN_CHAIN")], on),
        "cn": ([(cpu_ext, "NORMS")], on),
        "cm": ([(cpu_ext, "MTP_CHAIN")], on),
        "cr": ([(cpu_ext, "ROPE")], on),
        "cf": ([(cpu_ext, "MLP")], on),
        "cp": ([(cpu_ext, "PRODUCTS")], on),
        "cs": ([(cpu_ext, "CHOOSE")], on),
        "cw": ([(cpu_ext, "NARROW_TOP_K")], on),
        "dn": ([(cpu_ext, "DRAW_NOW")], on),
        "kh": ([(cpu_ext, "KV_HEADS_TOGETHER")], on),
        "cx": ([(cpu_ext, "SOFTMAX")], on),
        "cq": ([(cpu_ext, "CAUSAL")], on),
        "sr": ([(blas.SMALL_ROWS, "value")], lambda rest: (int(rest),)),
        "st": ([(blas.GEMM_THREADS, "value")], lambda rest: (int(rest),)),
        "ht": ([(spec_evidence, "WEAK_WAIT")], on),
        "gh": ([(cache, "HEADROOM")], on),
        "sl": ([(rounds, "START_LATE_ON_CPU")], on),
        "sa": ([(rounds, "START_AHEAD_LAYERS")], lambda rest: (int(rest),)),
        "ra": ([(rounds, "RESTART_ALONE_ON_CPU")], on),
        "rp": ([(rounds, "AHEAD_RAMP")], lambda rest: (int(rest),)),
        "dv": ([(rounds, "DRAW_VISITED_ON_CPU")], on),
        "sg": ([(segments, "SEGMENTS")], on),
        "ck": ([(choose_kernel.KERNEL, "value")], on),
        "cu": ([(mtp, "COUPLED_DRAWS")], on),
        "mp": ([(mtp, "MIN_PATH_PROB")], lambda rest: (int(rest) / 100,)),
        "sk": ([(mtp, "SKIP_CATCH_UP")], lambda rest: (int(rest),)),
        "lp": ([(launch_plan.SWITCH, "value")], on),
        "ap": ([(layer_plans.ATTENTION, "value")], on),
        "ac": ([(attention_rows, "ATTN_CHUNK")], lambda rest: (int(rest),)),
        "ak": ([(attention_rows, "ATTN_KEYS")], lambda rest: (int(rest),)),
        "am": ([(attention_rows, "MERGE_CHUNKS")], lambda rest: (int(rest),)),
        "ag": ([(attention_rows, "MERGE_GROUPS")], lambda rest: (int(rest),)),
        "ks": ([(qmm, "MMA_FEW_KW")], lambda rest: (int(rest),)),
        "kt": ([(qmm, "MMA_FEW_TILES")], lambda rest: (int(rest),)),
    }


@contextlib.contextmanager
def variant_setting(core: str) -> Iterator[None]:
    """Set what `core`'s suffixes name (the part before the first "-" is the caller's), and put
    every setting back afterwards."""
    settings = _settings()
    saved = [(owner, name, getattr(owner, name)) for places, _ in settings.values() for owner, name in places]
    try:
        for suffix in core.split("-")[1:]:
            prefix = next((p for p in settings if suffix.startswith(p)), None)
            if prefix is None:
                continue
            places, values = settings[prefix]
            for (owner, name), value in zip(places, values(suffix[len(prefix):]), strict=True):
                setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
