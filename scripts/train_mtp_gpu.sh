#!/usr/bin/env bash
# MTP-head recipes for the bundled target, side by side in one GPU call of at most ~10 minutes:
# the target's own continuations with their hidden states (drafter_data.py, the same data
# train_drafters_gpu.sh makes), then one `train_drafters.py mtp` run per recipe, all at once on the
# one GPU, each continuing from the shipped head (--init) for the same seconds, so the recipes
# differ only in what they train. Each run's head, log and held-out figures land in OUT/NAME.
#
#   scripts/train_mtp_gpu.sh OUT [TOTAL_SECONDS=570] [PROMPTS=build/drafter_prompts.json]
#
# PROMPTS as for train_drafters_gpu.sh (made on the dev machine). RECIPES (environment) is
# "NAME:ARGS;NAME:ARGS..." of extra train_drafters.py arguments; INIT the head they start from.
set -euo pipefail
OUT=$1
TOTAL=${2:-570}
PROMPTS=${3:-build/drafter_prompts.json}
DATA=build/drafter_data_gpu
INIT=${INIT:-engine/bundled/target}
RECIPES=${RECIPES:-"k2:--passes 2 --pass-decay 0.5 --soft 0;k6:--passes 6 --pass-decay 0.7 --soft 0;k6soft:--passes 6 --pass-decay 0.7 --soft 1;k6mix:--passes 6 --pass-decay 0.7 --soft 0.5"}
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $((TOTAL - ($(date +%s) - START))); }

source scripts/drafter_data_gpu.sh

# what is left, less 45 s for the loads, the final held-out evaluations and the saves
T=$(($(left) - 45))
PIDS=()
IFS=';' read -ra LIST <<<"$RECIPES"
for recipe in "${LIST[@]}"; do
    name=${recipe%%:*}
    # shellcheck disable=SC2086  # the recipe's arguments are words
    python scripts/train_drafters.py mtp --data "$DATA" --init "$INIT" --out "$OUT/$name" --steps 0 \
        --max-seconds "$T" --batch 16 --lr 1e-3 --warmup 100 --eval-every 500 ${recipe#*:} \
        >"$OUT/$name.log" 2>&1 &
    PIDS+=($!)
done
for p in "${PIDS[@]}"; do wait "$p" || echo "a recipe failed (its log says why)"; done
for recipe in "${LIST[@]}"; do
    name=${recipe%%:*}
    echo "$name: $(tail -n 1 "$OUT/$name.log")"
done
echo "total seconds: $(($(date +%s) - START))"
