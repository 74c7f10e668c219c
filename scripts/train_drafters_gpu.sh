#!/usr/bin/env bash
# The bundled target's three drafters in one GPU call of at most ~10 minutes (the device's limit
# per command): the target's own continuations with their hidden states (drafter_data.py), then
# the DFlash block drafter and the MTP head side by side on the one GPU, then the Weaver adapter
# over the new DFlash drafter. Each stage gets what is left of TOTAL seconds; the training steps
# are fixed from the measured speed (train_drafters.py --steps 0) and logged, so a rerun with
# `--steps N` repeats the schedule.
#
#   scripts/train_drafters_gpu.sh OUT [TOTAL_SECONDS=560] [PROMPTS=build/drafter_prompts.json]
#
# PROMPTS come from the dev machine (the corpus depends on its Python's stdlib):
#   python scripts/build_corpus.py build/bundled_data
#   python scripts/drafter_data.py --corpus build/bundled_data --save-prompts build/drafter_prompts.json \
#       --chat 4096 --code 2048 --fim 2048
# NEW_TOKENS and GEN_BATCH (environment) shrink the data for a dry run on a CPU. HEADS (default
# "dflash mtp weaver") picks what is trained; without dflash, Weaver trains over DFLASH (a
# directory) beside MTP. Data already in build/drafter_data_gpu from the same prompts is reused.
set -euo pipefail
OUT=$1
TOTAL=${2:-560}
PROMPTS=${3:-build/drafter_prompts.json}
DATA=build/drafter_data_gpu
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $((TOTAL - ($(date +%s) - START))); }

HEADS=${HEADS:-dflash mtp weaver}
has() { [[ " $HEADS " == *" $1 "* ]]; }
source scripts/drafter_data_gpu.sh

mtp() {  # $1: seconds
    python scripts/train_drafters.py mtp --data "$DATA" --out "$OUT/mtp" --steps 0 --max-seconds "$1" \
        --batch 16 --lr 1.5e-3 --warmup 100 --eval-every 500 >"$OUT/mtp.log" 2>&1
}

weaver() {  # $1: seconds, $2: the DFlash drafter it re-scores
    python scripts/train_drafters.py weaver --data "$DATA" --dflash "$2" --out "$OUT/weaver" --steps 0 \
        --max-seconds "$1" --batch 16 --anchors 16 --lr 1e-3 --warmup 100 --eval-every 500 >"$OUT/weaver.log" 2>&1
    tail -n 1 "$OUT/weaver.log"
}

if ! has dflash; then  # MTP and Weaver side by side, over an earlier DFlash drafter
    T=$(($(left) - 60))
    PIDS=()
    if has mtp; then
        mtp "$T" &
        PIDS+=($!)
    fi
    if has weaver; then
        weaver "$T" "${DFLASH:?HEADS without dflash needs DFLASH=dir for weaver}" &
        PIDS+=($!)
    fi
    for p in "${PIDS[@]}"; do wait "$p" || echo "a head failed (its log says why)"; done
    [[ -f $OUT/mtp.log ]] && tail -n 1 "$OUT/mtp.log"
    echo "total seconds: $(($(date +%s) - START))"
    exit 0
fi

# 70 % of what is left to DFlash and MTP (they share the GPU), the rest to Weaver; 60 s are kept
# for the loads and the final held-out evaluations.
T=$((($(left) - 60) * 7 / 10))
python scripts/train_drafters.py dflash --data "$DATA" --out "$OUT/dflash" --steps 0 --max-seconds "$T" \
    --batch 32 --anchors 16 --lr 1.5e-3 --warmup 100 --layers 2 --target-layers 1,4,7 \
    --eval-every 500 >"$OUT/dflash.log" 2>&1 &
DF=$!
mtp "$T" &
MT=$!
wait $DF || echo "dflash failed (its log says why)"
wait $MT || echo "mtp failed (its log says why)"
tail -n 1 "$OUT/dflash.log"
tail -n 1 "$OUT/mtp.log"
has weaver && weaver $(($(left) - 30)) "$OUT/dflash"
echo "total seconds: $(($(date +%s) - START))"
