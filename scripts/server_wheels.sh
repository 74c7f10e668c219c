#!/usr/bin/env bash
# Wheels of the server's Python dependencies for a machine that cannot reach PyPI (the H200 lent
# through the device tool: its image has MLX's CUDA libraries, torch and transformers, but not
# fastapi, pydantic, uvicorn or sse-starlette, so `spruce serve` and scripts/bench_peers.py cannot
# start there). Run here, where PyPI is reachable; carry the folder; install there.
#
#   scripts/server_wheels.sh [DIR] [PYTHON_VERSION]     # default .whl/server, 3.12 (the H200's)
#   # on the GPU machine, after `source .whl/setup.sh`:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/server/*.whl
set -euo pipefail
dir=${1:-.whl/server}
py=${2:-3.12}
mkdir -p "$dir"
# the server's runtime dependencies that the H200 image lacks (pyproject.toml lists them all);
# binary wheels for the target Python and manylinux x86_64, dependencies resolved for it
python3 -m pip download --quiet --dest "$dir" --only-binary=:all: --python-version "$py" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 --implementation cp \
  fastapi uvicorn sse-starlette pydantic "llguidance>=1.9,<2"
ls "$dir"
