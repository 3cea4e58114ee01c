#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv and installs xorl into it.
# Sourced by scripts/train.sh and scripts/test.sh, so each README command does all its own set-up.
# Why torch is pinned on machines without a GPU: an unpinned `torch` pulls a multi-GB CUDA build,
# while torch==2.13.0 resolves to the local CPU build there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${XORL_VENV:-$root/.venv}"
stamp="$venv/.xorl-installed"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"

# Reinstall when the project's install recipe changed since the last install.
want="$(cat "$root/pyproject.toml" "$root/setup.py" "$root/CMakeLists.txt" "$root"/csrc/* 2>/dev/null | sha1sum | cut -c1-40)"
have="$(cat "$stamp" 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
  python -m pip install -q --upgrade pip
  if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      python -m pip install -q torch
    else
      python -m pip install -q "torch==${XORL_CPU_TORCH:-2.13.0}"
    fi
  fi
  python -m pip install -q -e "$root[test]"
  echo "$want" >"$stamp"
fi
