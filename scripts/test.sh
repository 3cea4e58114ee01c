#!/usr/bin/env bash
# The test command from the README: sets up .venv if needed, then runs the whole CPU suite (the CI
# command). GPU tests are marked `gpu` and skip where there is no CUDA device.
# `--quick` (first argument) runs the quick tier, -m "not slow and not gpu": no test that starts
# other processes (subprocess, torchrun, gloo worlds); imports, config rules, kernel references
# and a one-process training step, in about a minute. Other arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/setup_env.sh"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two pytest-xdist workers (XORL_TEST_WORKERS=N for another count, 0 for none): a third of a 2-core
# machine's time was idle with one (process start-ups, ranks waiting on each other, timeouts under
# test). loadfile sends each test file whole to one worker, so a module fixture (the host-memory
# model, the parity references) is computed once. (loadgroup would be finer, but with pytest 9 it
# ignores xdist_group.) Where pytest-xdist is not installed (an offline GPU image) the suite runs
# in one process.
marks=()
if [ "${1:-}" = "--quick" ]; then
  shift
  marks=(-m "not slow and not gpu")
fi
workers="${XORL_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ] && python -c "import xdist" 2>/dev/null; then
  parallel=(-n "$workers" --dist loadfile)
fi
exec python -m pytest -q tests "${parallel[@]}" "${marks[@]}" "$@"
