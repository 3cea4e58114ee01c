#!/usr/bin/env bash
# The main job from the README: sets up .venv if needed, then runs the trainer on its built-in
# default (a small model on CPU with gloo ranks). Extra arguments go to xorl-train.
# The config (and the run folder, and any checkpoint to resume) is checked once before torchrun
# starts, so a run that cannot work is one message with exit code 2, not one failure per rank.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/setup_env.sh"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
nproc_per_node="${NPROC_PER_NODE:-4}"
python -m xorl.cli.train --check --world-size="$nproc_per_node" "$@" >/dev/null
exec torchrun --standalone --nproc_per_node="$nproc_per_node" -m xorl.cli.train "$@"
