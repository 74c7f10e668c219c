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
# - ktests: the GPU tests of the kernels the forty-eighth session changed (attention keys loaded
#   together, norms held in registers, qmm_mma's warps for few tiles) and of the model's wirings;
# - ncu: one 9B-shaped decode step's kernels under ncu, once a setting: the defaults, the attention
#   walking one key at a time ("-ak1"), qmm_mma with 8 and 16 warps for weights of few tiles
#   ("-ks8", "-ks16"), and the defaults with the kernels before that session (.old48/, the
#   committed texts carried as an ignored folder: attn_rows, add_norm, gated_norm, gdn_step);
#   NCU_VARIANTS lists the settings after the defaults, NCU_PROMPT the context (default 128 tokens);
#   for the next lease: NCU_VARIANTS="-am4 -ac16-am4 -ac8-am8" (the merge loading chunks together,
#   written after the forty-eighth session's lease), the same with NCU_PROMPT=4096 and "-ak1" (do
#   smaller chunks and the keys' batches hold at a long context, one launch at a time?), and
#   NCU_VARIANTS="-kt2048" (8 warps for every short reduction: the GDN in_proj and gate|up reach
#   55-67 % of their floor);
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
              tests/engine/test_qlinear.py tests/engine/test_lossless.py \
              -k "gpu or launch_plan or plan_ or launch_plans or attention or mma" -rA \
              | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error"
            echo "pytest rc ${PIPESTATUS[0]}" ;;
    ncu) ncu_step() {  # name, variant
           timeout 150 /usr/local/cuda/bin/ncu --clock-control none --profile-from-start off --csv \
             --metrics gpu__time_duration.sum python scripts/profile_gpu.py --out "$OUT/ncu_$1" --shape 9b \
             --layers 32 --rows 1 --ncu "--variant=$2" \
             --prompt-tokens "${NCU_PROMPT:-128}" > "$OUT/ncu_$1.csv" 2> "$OUT/ncu_$1.err"
           echo "## $1 ($2)"; python scripts/ncu_summary.py "$OUT/ncu_$1.csv" --top 40
         }
         ncu_step default ""; for v in ${NCU_VARIANTS:--ak1 -ks8 -ks16}; do ncu_step "${v//-/}" "$v"; done
         if [ -d .old48 ]; then
           for k in attn_rows add_norm gated_norm gdn_step; do cp metal/$k.kernel /tmp/$k.kernel.new; cp .old48/$k.kernel metal/; done
           ncu_step old48 ""
           for k in attn_rows add_norm gated_norm gdn_step; do cp /tmp/$k.kernel.new metal/$k.kernel; done
         fi ;;
    widen) [ -f /tmp/q9/target/config.json ] || timeout 120 python scripts/widen_checkpoint.py /tmp/q9 --shape 9b --bits 4 ;;
    rounds) timeout 500 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
              --dtype bfloat16 --methods none,mtp:chain,mtp:ddtree,dflash:chain --kinds code,chat --runs 2 \
              --tokens 128 --variants engine,lp0 --json "$OUT/rounds.json" ;;
    *) echo "unknown stage $stage" ;;
  esac 2>&1 | tee "$OUT/$stage.log"
  echo "== $stage: $(( $(date +%s) - start )) s" | tee -a "$OUT/times.log"
done
