#!/usr/bin/env bash
# Every kernel and engine test on a GPU in one call: pytest spread over the machine's cores.
#   source .whl/setup.sh && OUT=DIR bash scripts/gpu_tests.sh [pytest selection ...]
# (default selection: tests/kernels tests/engine; the CPU-only tests there skip themselves on a GPU).
#
# Serial, a GPU run of these is mostly NVRTC compiling each kernel build the tests ask for, on one
# core: two 500 s calls reached ~290 of ~330 GPU kernel tests on an H100 (fifty-seventh session).
# With pytest-xdist the compiles run on WORKERS cores at once (MLX keeps what one process compiled
# in its on-disk PTX cache, which the others then read). xdist is not in the GPU machine's image and
# nothing can be downloaded there, so its wheels travel in .whl/ with MLX's (setup.sh installs
# every wheel there), once per checkout:
#   pip download --no-deps pytest-xdist execnet -d .whl/
# Without them the tests run serially.
#
# Writes $OUT/gpu_tests.log: one line per test (PASSED / FAILED / SKIPPED / ERROR, the worker that
# ran it), the failures' tracebacks, the slowest tests and pytest's summary; a run cut by LIMIT
# (seconds, default 540) still has every line up to then. Prints the counts and the failures.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
WORKERS=${WORKERS:-12}
LIMIT=${LIMIT:-540}
log="$OUT/gpu_tests.log"
spread=()
if python -c "import xdist" 2>/dev/null; then
  spread=(-n "$WORKERS")
else
  echo "pytest-xdist not installed: the tests run serially (see the header)" | tee "$log"
fi
# the engine's extensions built once here, not by every worker at once
timeout 300 python -c "from engine import cpu_ext, cuda_ext; cpu_ext.module(); cuda_ext.module()" >> "$log" 2>&1
start=$(date +%s)
# shellcheck disable=SC2068
timeout "$LIMIT" python -m pytest -o addopts="" -v -p no:cacheprovider "${spread[@]}" -rfE --durations=20 ${@:-tests/kernels tests/engine} \
  >> "$log" 2>&1
rc=$?
echo "pytest rc $rc after $(( $(date +%s) - start )) s (124: cut by LIMIT=$LIMIT)" | tee -a "$log"
for outcome in PASSED FAILED ERROR SKIPPED XFAIL; do
  printf '%s %s\n' "$outcome" "$(grep -c " $outcome " "$log")"
done
grep -E " (FAILED|ERROR) " "$log" | head -40
tail -3 "$log"
