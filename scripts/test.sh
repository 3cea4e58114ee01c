#!/usr/bin/env bash
# The test command from the README: sets up .venv if needed, then runs the whole CPU suite.
# GPU tests are marked `gpu` and skip where there is no CUDA device.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/setup_env.sh"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -q tests "$@"
