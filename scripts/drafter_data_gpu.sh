#!/usr/bin/env bash
# Sourced by the GPU training scripts (train_drafters_gpu.sh, train_mtp_gpu.sh): the bundled
# target's own continuations of PROMPTS with their hidden states in DATA (drafter_data.py), made
# once and reused while DATA holds the same prompts; the log in OUT/data.log. NEW_TOKENS and
# GEN_BATCH (environment) shrink the data for a dry run on a CPU.
if [[ -f $DATA/summary.json ]] && grep -q "\"prompts\": \"$PROMPTS\"" "$DATA/summary.json"; then
    echo "reusing $DATA"
else
    python scripts/drafter_data.py --prompts "$PROMPTS" --out "$DATA" --new-tokens "${NEW_TOKENS:-192}" \
        --batch "${GEN_BATCH:-512}" >"$OUT/data.log" 2>&1
    tail -n 1 "$OUT/data.log"
fi
