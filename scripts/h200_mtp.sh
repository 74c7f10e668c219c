#!/usr/bin/env bash
# The MTP head on a GPU (issue 12). On the 4-bit 9B-shaped pair a chain round is bound by the host
# encoding its launches, and each drafted depth adds ~58 of them (BENCHMARKS.md, twenty-fourth
# session). depths: chains of 3-6 depths (the CPU's best, 6, need not be the GPU's); draft-attn:
# the drafted row's attention in two launches (engine/attention_rows.py, attention_draft_row)
# against its ops form, its GPU tests, then rounds with it on and off ("-ad0") and each one's
# launches a depth. One process a stage, the methods and variants interleaved run by run, greedy,
# 128 tokens.
#   source .whl/setup.sh && OUT=DIR bash scripts/h200_mtp.sh [stage ...]
# Stages: widen (writes /tmp/q9 from the bundled pair: needs its weights), depths, draft-attn-tests
# (no bundled weights needed), draft-attn, controller (the working tree's tree-size controller
# against the one in $AGAINST: a git revision, or a directory holding `git archive REV engine`'s
# files where the machine has no git history; MTP DDTree and chains sized by each, beside plain
# decoding, where guesses miss and on code, chat and the long prompt), controller-fixed (the same
# texts: the working tree's controller against every round at the full budget and against itself
# without the confidence gate), plain-rounds (what a plain round costs with MTP on, where guesses
# miss, against plain decoding's, with the confidence off and with no controller between rounds;
# the n-gram drafter beside MTP tells apart what MTP's feature rows and bookkeeping cost:
# scripts/profile_plain_rounds.py); misses-trace (the same where guesses miss, the engine alone, and
# the last run's tree rounds with the round after each: where the loss against plain decoding goes).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export MLX_ENABLE_TF32=0
stages=${*:-widen depths}
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    widen) [ -f /tmp/q9/target/config.json ] || timeout 120 python scripts/widen_checkpoint.py /tmp/q9 --shape 9b --bits 4 ;;
    depths) timeout 420 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
           --dtype bfloat16 --methods none,mtp:chain/d3,mtp:chain/d4,mtp:chain/d5,mtp:chain \
           --kinds code,chat --runs 2 --tokens 128 --json "$OUT/depths.json" ;;
    draft-attn-tests) # the kernel against its twin (~60 s); then the head's compiled steps against the plain
         # ones, which did not finish within 200 s on the H100 (thirty-fifth session): their own limit
         timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_rows.py -k gpu -rA \
           | grep -E "^(PASSED|FAILED|ERROR)|passed|failed"; echo "pytest rc ${PIPESTATUS[0]}"
         timeout 400 python -m pytest -q -p no:cacheprovider tests/engine/test_mtp_steps.py -rA \
           | grep -E "^(PASSED|FAILED|ERROR)|passed|failed"; echo "pytest rc ${PIPESTATUS[0]}" ;;
    draft-attn) timeout 300 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
           --dtype bfloat16 --methods none,mtp:chain --kinds code,chat --runs 3 --tokens 128 \
           --variants engine,ad0 --json "$OUT/draft-attn.json"
         for v in 1 0; do SPRUCE_ATTN_DRAFT=$v timeout 100 python scripts/count_graph_ops.py --model /tmp/q9/target \
           --dtype bfloat16 --sizes 1 | grep -E "^mtp"; done ;;
    controller) timeout 540 python scripts/bench_controller.py --against "${AGAINST:-HEAD~1}" --model /tmp/q9/target \
           --dflash-model /tmp/q9/dflash --methods mtp,mtp-chain --lengths 64 --kinds code,chat,long --runs 3 ;;
    controller-fixed) timeout 540 python scripts/bench_controller.py --fixed --gate-off --model /tmp/q9/target \
           --dflash-model /tmp/q9/dflash --methods mtp-chain,mtp --lengths 64 --kinds code,chat,long --runs 3 ;;
    misses-trace) timeout 300 python scripts/profile_plain_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
           --dtype bfloat16 --methods ngram,mtp,mtp-chain --probes engine --runs 5 --trace ;;
    plain-rounds) timeout 400 python scripts/profile_plain_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
           --dtype bfloat16 --methods mtp-chain,mtp,ngram --probes engine,nc,pl --runs 5 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac > "$OUT/$stage.log" 2>&1
  echo "$stage: rc $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.log"
done
