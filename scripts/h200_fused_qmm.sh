#!/usr/bin/env bash
# The H200 measurements of the fused qmm_mma builds (issue 13), as BENCHMARKS.md's thirtieth
# session lists them, stage by stage with a time limit each and one log each under $OUT.
#   source .whl/setup.sh && bash scripts/h200_fused_qmm.sh [stage ...]
# Stages: widen tests ops e2e rounds (default: all, in that order); rounds-short: the rounds of
# the default engine and the fused builds only, two runs (for a lease with little time left);
# qf-ab: the default engine against the fused builds alone, more runs of rounds and end to end;
# qr-ab: the residual builds alone (-qr1) against the default engine and all builds; qr-host:
# their test and the host's and device's share of random-weight verifies (no bundled weights);
# host-ab: the host's share of random-weight verifies, this tree against ab_old/ (engine, scripts
# and metal of an older commit), and where the graph's views come from (scripts/view_sites.py);
# qp and qp-e2e: the thirty-fourth session's prologue spread over the warp, its tests and build
# timings (no bundled weights), then end to end; qp-ncu: ncu's view of the norm and SwiGLU builds
# against the plain one (no bundled weights).
# `widen` writes the 4-bit 9B-shaped pair to /tmp/q9, which the later stages read. e2e and rounds
# also run the twenty-ninth session's add + norm kernel (-an1), whose rounds were not measured
# after its fix.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export MLX_ENABLE_TF32=0
stages=${*:-widen tests ops e2e rounds}
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    widen) [ -f /tmp/q9/target/config.json ] || timeout 120 python scripts/widen_checkpoint.py /tmp/q9 --shape 9b --bits 4 ;;
    tests) timeout 170 python -m pytest -q -p no:cacheprovider tests/kernels/test_qmm.py tests/engine/test_qlinear.py -k "mma or fused" ;;
    ops) SPRUCE_QMM_FUSE=1 timeout 90 python scripts/count_graph_ops.py --model /tmp/q9/target --dtype bfloat16 --sizes 1,17
         timeout 90 python scripts/count_graph_ops.py --model /tmp/q9/target --dtype bfloat16 --sizes 1,17 ;;
    e2e) timeout 280 python scripts/bench_gpu.py --out "$OUT/e2e" --targets "" --checkpoint q9=/tmp/q9/target \
           --skip-draft --runs 5 --tokens 128 --tree-sizes 1,17 --ops-tree-sizes "" --micro "" \
           --prefill-tokens 0 --cores kernels,kernels-qf1,kernels-an1 ;;
    rounds) timeout 400 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
           --dtype bfloat16 --methods none,mtp:chain --kinds code,chat --runs 3 --tokens 128 \
           --variants engine,qf1,qf1-gn1,an1 --json "$OUT/rounds.json" ;;
    rounds-short) timeout 300 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
           --dtype bfloat16 --methods none,mtp:chain --kinds code,chat --runs 2 --tokens 128 \
           --variants engine,qf1 --json "$OUT/rounds.json" ;;
    qf-ab) timeout 240 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
           --dtype bfloat16 --methods none,mtp:chain --kinds code,chat --runs 5 --tokens 128 \
           --variants engine,qf1 --json "$OUT/qf-ab.json"
         timeout 200 python scripts/bench_gpu.py --out "$OUT/e2e-qf" --targets "" --checkpoint q9=/tmp/q9/target \
           --skip-draft --runs 7 --tokens 128 --tree-sizes 1,17 --ops-tree-sizes "" --micro "" \
           --prefill-tokens 0 --cores kernels,kernels-qf1 ;;
    qr-ab) timeout 100 python -m pytest -q -p no:cacheprovider tests/engine/test_qlinear.py -k "residual_builds or fused_builds"
         timeout 200 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
           --dtype bfloat16 --methods none,mtp:chain --kinds code,chat --runs 3 --tokens 128 \
           --variants engine,qr1,qf1 --json "$OUT/qr-ab.json"
         timeout 150 python scripts/bench_gpu.py --out "$OUT/e2e-qr" --targets "" --checkpoint q9=/tmp/q9/target \
           --skip-draft --runs 5 --tokens 128 --tree-sizes 1,17 --ops-tree-sizes "" --micro "" \
           --prefill-tokens 0 --cores kernels,kernels-qr1 ;;
    qr-host) timeout 80 python -m pytest -q -p no:cacheprovider tests/engine/test_qlinear.py -k "residual_builds"
         for i in 1 2; do for f in 0 1; do
           SPRUCE_QMM_RES=$f timeout 45 python scripts/profile_host.py --out "$OUT/host-res$f-$i" --shape 9b \
             --rows 1,17 --runs 6 | grep -v "^ "
         done; done ;;
    qp) # the prologue spread over the warp (SHARE_ROWS in metal/qmm_mma.kernel): its GPU tests,
        # each build's µs beside the plain one, and the device's share of random-weight verifies
        # with all builds, the residual builds alone and none (no bundled weights needed)
         timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_qmm.py -k "fused_builds or mma_kernel_equals" -rA | grep -E "^(PASSED|FAILED|ERROR)|passed|failed"; echo "pytest rc ${PIPESTATUS[0]}"
         timeout 100 python -m pytest -q -p no:cacheprovider tests/engine/test_qlinear.py -k "fused_builds or residual_builds" -rA | grep -E "^(PASSED|FAILED|ERROR)|passed|failed"; echo "pytest rc ${PIPESTATUS[0]}"
         timeout 120 python scripts/bench_qmm.py --builds plain,norm,res,swiglu-res --rows 1,2,4,17 \
           --shapes "9b gdn in_proj fused,9b mlp gate|up fused,9b mlp down,9b gdn out_proj"
         for i in 1 2; do for v in "0 0" "1 0" "0 1"; do set -- $v
           SPRUCE_QMM_FUSE=$1 SPRUCE_QMM_RES=$2 timeout 45 python scripts/profile_host.py --out "$OUT/host-qf$1-qr$2-$i" \
             --shape 9b --rows 1,17 --runs 6 | grep -v "^ "
         done; done ;;
    qp-e2e) timeout 220 python scripts/bench_gpu.py --out "$OUT/e2e-qp" --targets "" --checkpoint q9=/tmp/q9/target \
           --skip-draft --runs 5 --tokens 128 --tree-sizes 1,17 --ops-tree-sizes "" --micro "" \
           --prefill-tokens 0 --cores kernels,kernels-qf1,kernels-qr1
         timeout 200 python scripts/profile_rounds.py --model /tmp/q9/target --dflash-model /tmp/q9/dflash \
           --dtype bfloat16 --methods none,mtp:chain --kinds code,chat --runs 2 --tokens 128 \
           --variants engine,qf1,qr1 --json "$OUT/qp-rounds.json" ;;
    qp-ncu) # what the device does in the norm and SwiGLU builds against the plain one at one row:
        # their tests, each build's µs, and ncu's occupancy, warp stalls and throughput for one launch
         timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_qmm.py -k "fused_builds" -rA | grep -E "^(PASSED|FAILED|ERROR)|passed|failed"; echo "pytest rc ${PIPESTATUS[0]}"
         timeout 100 python -m pytest -q -p no:cacheprovider tests/engine/test_qlinear.py -k "fused_builds or residual_builds" -rA | grep -E "^(PASSED|FAILED|ERROR)|passed|failed"; echo "pytest rc ${PIPESTATUS[0]}"
         timeout 100 python scripts/bench_qmm.py --builds plain,norm,res,swiglu-res --rows 1,2,4,17 \
           --shapes "9b gdn in_proj fused,9b mlp gate|up fused,9b mlp down,9b gdn out_proj"
         ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
         i=0
         for spec in "plain;9b mlp gate|up fused" "norm;9b mlp gate|up fused" "plain;9b mlp down" \
                     "swiglu-res;9b mlp down"; do
           i=$((i + 1))
           timeout 90 "$ncu" --section SpeedOfLight --section Occupancy --section WarpStateStats \
             --section LaunchStats --section SchedulerStats -k regex:qmm_mma -s 3 -c 1 \
             python scripts/bench_qmm.py --builds "${spec%%;*}" --rows 1 --shapes "${spec#*;}" --launches 4 \
             > "$OUT/ncu-$i-${spec%%;*}.txt" 2>&1
         done ;;
    host-ab) # this tree against an older one unpacked in ab_old/ (`git archive REV engine scripts metal
         # ':!engine/bundled/*/*.safetensors' | tar -x -C ab_old`), random 9B weights, alternated
         for i in 1 2; do for dir in . ab_old; do
           [ -d "$dir/engine" ] || continue
           timeout 50 python "$dir/scripts/profile_host.py" --out "$OUT/host-$i-${dir//[.\/]/}" --shape 9b \
             --rows 1,17 --runs 6 | grep -v "^ "
         done; done
         timeout 60 python scripts/view_sites.py --rows 1,17 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac > "$OUT/$stage.log" 2>&1
  echo "$stage: rc $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.log"
done
