#!/usr/bin/env bash
# The sampler's choice in one CUDA launch (engine/choose_kernel.py, metal/choose.kernel; issue 13)
# on a GPU, stage by stage with a time limit each, one log each under $OUT.
#   source .whl/setup.sh && OUT=DIR bash scripts/gpu_choose.sh [stage ...]
# Stages (default: tests micro widen rounds):
# - tests: the kernel against the host's float64 sampler and the operations (bf16 rows of the 9B's
#   248,320 tokens and fp32 rows of 8,192), rows independent of the launch, greedy and top; the
#   device sampler's own tests beside it (no bundled weights needed);
# - micro: scripts/bench_choose.py, the host's and the device's time a choice, operations against
#   the kernel, alternated in one process (no bundled weights needed);
# - widen: the 4-bit 9B-shaped pair in /tmp/q9 (needs the bundled weights);
# - rounds: plain decoding and MTP chains on that pair under the bundled model's default sampling,
#   the kernel on and off ("-ck0") interleaved run by run; rounds-greedy: the same greedy (the
#   greedy rows' top-token probability is the kernel's other use);
# - lossless: speculation against plain decoding with the kernel in the choice, penalties included
#   (tiny fp32 models).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export MLX_ENABLE_TF32=0
stages=${*:-tests micro widen rounds}
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests) timeout 300 python -m pytest -q -p no:cacheprovider tests/kernels/test_choose_kernel.py \
             tests/unit/test_device_sampler.py -rA | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error"
           echo "pytest rc ${PIPESTATUS[0]}" ;;
    micro) timeout 240 python scripts/bench_choose.py --rows 1,17 --runs 30 ;;
    widen) [ -f /tmp/q9/target/config.json ] || timeout 120 python scripts/widen_checkpoint.py /tmp/q9 --shape 9b --bits 4 ;;
    rounds) timeout 400 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
              --dtype bfloat16 --methods none,mtp:chain --kinds code --runs 3 --tokens 128 --defaults --seed 0 \
              --variants engine,ck0 --json "$OUT/rounds-sampled.json" ;;
    rounds-greedy) timeout 300 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
              --dtype bfloat16 --methods none,mtp:chain --kinds code --runs 2 --tokens 128 \
              --variants engine,ck0 --json "$OUT/rounds-greedy.json" ;;
    lossless) timeout 400 python -m pytest -q -p no:cacheprovider tests/engine/test_lossless.py tests/engine/test_penalties_logprobs.py -k "spec_equals_plain or stops_where_plain or lossless_and_matter or what_the_host" \
                | tail -5 ;;
    *) echo "unknown stage $stage" ;;
  esac 2>&1 | tee "$OUT/$stage.log"
  echo "== $stage: $(( $(date +%s) - start )) s" | tee -a "$OUT/times.log"
done
