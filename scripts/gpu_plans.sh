#!/usr/bin/env bash
# Launch plans (engine/launch_plan.py, engine/cuda_ext.cpp, engine/layer_plans.py; issue 13) on a
# GPU, stage by stage with a time limit each, one log each under $OUT.
#   source .whl/setup.sh && OUT=DIR bash scripts/gpu_plans.sh [stage ...]
# Stages (default: tests layers e2e):
# - tests: the plans' and their kernels' GPU tests, the model with plans against the same wiring
#   launch by launch, and the GPU tests of the other wirings (which turn plans off);
# - layers: scripts/bench_launch_plan.py, 24 GDN layers of the 9B shape, launches one by one
#   against one plan a layer (host and device time, bitwise check);
# - e2e: plain decoding beside mlx-lm, every plan on (the attention layers' too: "-ap1"), the GDN
#   layers' alone (the default) and none ("-lp0"), interleaved;
# - host: scripts/profile_host.py's one-row step (build, encode, wait, and a cProfile of the build)
#   with every plan, with the GDN layers' alone, and with none;
# - attention: scripts/bench_attention_rows.py, the attention kernel's µs a call by chunk size at the
#   9B shape, then plain decoding with chunks of 32 (the default), 8 and 16 ("-acN") beside mlx-lm
#   (written in the forty-seventh session, not run yet);
# - ktests: the GPU tests of the kernels the forty-eighth and forty-ninth sessions changed (attention
#   keys loaded together, norms held in registers, qmm_mma's warps for few tiles, the GDN step with
#   its gated norm in one launch) and of the model's wirings;
# - gtests: the gated step's alone (against its two launches, in a plan, and in the model: ~2 min
#   on an H100; with every plan test besides, as it was, it passed 300 s in the fiftieth session);
# - ncu: one 9B-shaped decode step's kernels under ncu, once a setting: the defaults, then each of
#   NCU_VARIANTS (default: the step and its gated norm in one launch, "-gs1", also with 32 SIMD
#   groups a head, "-gs1-gw32"); NCU_PROMPT sets the context (default 128 tokens). The fifty-first
#   session ran NCU_PROMPT=4096 NCU_VARIANTS="-ac16-am4": the merge was 113 us a layer at 4k.
#   Its second lease ran NCU_VARIANTS="-ag8" there (the merge shared by 8 SIMD groups: 23 us).
#   The fifty-second ran NCU_PROMPT=4096 NCU_VARIANTS="-ag1 -ag4" (merge 113.9 / 40.5 / 22.0 us a
#   layer with 1 / 4 / 8 groups) and NCU_VARIANTS="-kt2048" (no change);
# - gated: plain decoding beside mlx-lm without the gated step (the default) and with it ("-gs1"),
#   or the settings GATED_CORES lists, GATED_RUNS runs each (default 4) within GATED_TIMEOUT seconds
#   (default 580; with `gtests` in the same call: GATED_RUNS=2 GATED_TIMEOUT=280), after a prompt
#   of GATED_PROMPT random ids (default 128; the fifty-second session ran GATED_PROMPT=4096
#   GATED_CORES=kernels,kernels-ag1: 275.5 against 253.6 tok/s, mlx-lm 112.9);
#   the gated step's whole check in two calls while the machine is warm: `gtests ncu` with
#   NCU_VARIANTS="-gs1", then `gated`;
# - (the fifty-third session ran a `prefetch` stage here: qmm_mma loading 2 and 3 steps of weights
#   ahead lost 12 % of plain decoding on an H100, and the depth was taken out of the kernel);
# - verify: a 17-row verify against a one-row step, kernel by kernel under ncu (profile_gpu.py --rows
#   1,17, caches flushed before each kernel, as ncu does), then the round's time by tree size beside
#   mlx-lm (bench_gpu.py --tree-sizes 1,8,9,16,17,24,25,32); the fifty-third session's tables (~6 min);
# - widen: the 4-bit 9B-shaped pair in /tmp/q9 (needs the bundled weights);
# - rounds: plain decoding, MTP chains and DDTree and DFlash chains on that pair, greedy, plans on and
#   off interleaved run by run (what plans do to speculation's rounds: not measured yet).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export MLX_ENABLE_TF32=0
stages=${*:-tests layers e2e}
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests) timeout 400 python -m pytest -q -p no:cacheprovider tests/kernels/test_launch_plan.py \
             tests/kernels/test_fused_norms.py tests/engine/test_qlinear.py tests/engine/test_lossless.py \
             -k "gpu or launch_plan or plan_ or launch_plans or residual_builds or fused_builds or opt_in_kernels" -rA \
             | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error"
           echo "pytest rc ${PIPESTATUS[0]}" ;;
    layers) timeout 200 python scripts/bench_launch_plan.py --out "$OUT/layers" --shape 9b --layers 24 --steps 32 \
              --runs 4 ;;
    e2e) timeout 400 python scripts/bench_gpu.py --out "$OUT/e2e" --targets 9b --skip-draft --runs 6 --tokens 128 \
           --tree-sizes 1,17 --ops-tree-sizes "" --micro "" --prefill-tokens 0 \
           --cores kernels-ap1,kernels,kernels-lp0 | grep -v '^ \|^{\|^}' ;;
    host) for v in 1:1 1:0 0:0; do
            SPRUCE_LAUNCH_PLANS=${v%:*} SPRUCE_ATTENTION_PLANS=${v#*:} timeout 150 python scripts/profile_host.py \
              --out "$OUT/host_${v/:/_}" --shape 9b --rows 1 --runs 24 | grep -v "^ *[0-9]* *0.0"
          done ;;
    attention) timeout 200 python scripts/bench_attention_rows.py --out "$OUT/attention"
               timeout 400 python scripts/bench_gpu.py --out "$OUT/e2e_chunks" --targets 9b --skip-draft --runs 4 \
                 --tokens 128 --tree-sizes 1,17 --ops-tree-sizes "" --micro "" --prefill-tokens 0 \
                 --cores kernels,kernels-ac8,kernels-ac16 | grep -v '^ \|^{\|^}' ;;
    ktests) timeout 500 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_rows.py \
              tests/kernels/test_fused_norms.py tests/kernels/test_qmm.py tests/kernels/test_launch_plan.py \
              tests/kernels/test_gdn_kernels.py tests/engine/test_qlinear.py tests/engine/test_lossless.py \
              -k "gpu or launch_plan or plan_ or launch_plans or attention or mma or gated_step" -rA \
              | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error"
            echo "pytest rc ${PIPESTATUS[0]}" ;;
    gtests) timeout 300 python -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_kernels.py \
              tests/kernels/test_launch_plan.py tests/engine/test_qlinear.py -k "gated" -rA \
              | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error"
            echo "pytest rc ${PIPESTATUS[0]}" ;;
    ncu) ncu_step() {  # name, variant
           timeout 150 /usr/local/cuda/bin/ncu --clock-control none --profile-from-start off --csv \
             --metrics gpu__time_duration.sum python scripts/profile_gpu.py --out "$OUT/ncu_$1" --shape 9b \
             --layers 32 --rows 1 --ncu "--variant=$2" \
             --prompt-tokens "${NCU_PROMPT:-128}" > "$OUT/ncu_$1.csv" 2> "$OUT/ncu_$1.err"
           echo "## $1 ($2)"; python scripts/ncu_summary.py "$OUT/ncu_$1.csv" --top 40
         }
         ncu_step default ""; for v in ${NCU_VARIANTS:--gs1 -gs1-gw32}; do ncu_step "${v//-/}" "$v"; done ;;
    gated) timeout "${GATED_TIMEOUT:-580}" python scripts/bench_gpu.py --out "$OUT/e2e_gated" --targets 9b --skip-draft \
             --runs "${GATED_RUNS:-4}" --prompt-tokens "${GATED_PROMPT:-128}" \
             --tokens 128 --tree-sizes 1 --ops-tree-sizes "" --micro "" --prefill-tokens 0 \
             --cores "${GATED_CORES:-kernels,kernels-gs1}" | grep -v '^ \|^{\|^}' ;;
    verify) timeout 280 /usr/local/cuda/bin/ncu --clock-control none --profile-from-start off --csv \
              --metrics gpu__time_duration.sum python scripts/profile_gpu.py --out "$OUT/ncu_verify" --shape 9b \
              --layers 32 --rows 1,17 --ncu "--variant=" --prompt-tokens 128 > "$OUT/ncu_verify.csv" 2> "$OUT/ncu_verify.err"
            python scripts/ncu_summary.py "$OUT/ncu_verify.csv" --top 45
            timeout 420 python scripts/bench_gpu.py --out "$OUT/e2e_sizes" --targets 9b --skip-draft --runs 2 \
              --tokens 128 --tree-sizes 1,8,9,16,17,24,25,32 --ops-tree-sizes "" --micro "" --prefill-tokens 0 \
              --cores kernels | grep -v '^ \|^{\|^}' ;;
    widen) [ -f /tmp/q9/target/config.json ] || timeout 120 python scripts/widen_checkpoint.py /tmp/q9 --shape 9b --bits 4 ;;
    rounds) timeout 500 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
              --dtype bfloat16 --methods none,mtp:chain,mtp:ddtree,dflash:chain --kinds code,chat --runs 2 \
              --tokens 128 --variants engine,lp0 --json "$OUT/rounds.json" ;;
    *) echo "unknown stage $stage" ;;
  esac 2>&1 | tee "$OUT/$stage.log"
  echo "== $stage: $(( $(date +%s) - start )) s" | tee -a "$OUT/times.log"
done
