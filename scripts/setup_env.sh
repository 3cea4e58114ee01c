#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv and installs xorl into it.
# Sourced by scripts/train.sh and scripts/test.sh, so each README command does all its own set-up.
#
# Two ways, chosen automatically:
# - A python3 that already has a CUDA build of torch (a GPU machine's image, often with no access to
#   a package registry): the venv sees the system packages (--system-site-packages) and xorl is
#   installed without network: no build isolation, no dependency resolution. Force this way with
#   XORL_OFFLINE=1 (it then needs torch, setuptools, wheel and pybind11 installed already).
# - Otherwise: a fresh venv, torch pinned to the local CPU build on machines without a GPU (an
#   unpinned `torch` pulls a multi-GB CUDA build; torch==2.13.0 resolves to the local CPU build),
#   then `pip install -e .[test]`.
#
# Each phase says what it does on stderr ("xorl setup: ..."): pip stays quiet, but a first set-up
# that downloads torch takes minutes and must not look like a hang.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { echo "xorl setup: $*" >&2; }
venv="${XORL_VENV:-$root/.venv}"
stamp="$venv/.xorl-installed"
py="${PYTHON:-python3}"

offline="${XORL_OFFLINE:-}"
if [ -z "$offline" ] && "$py" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  offline=1
fi

# --system-site-packages shows a new venv its BASE interpreter's packages only. Where "$py" is itself
# a venv's python (the GPU image's python3 is /opt/torch/.venv/bin/python3, with torch, setuptools,
# pybind11 and pip inside that venv), the new venv is made without a pip of its own (an older
# setuptools would come with it and shadow the image's) and a .pth file of ours adds that venv's
# site-packages as site dirs (so their own .pth files, editable installs included, count too);
# rewritten each time, so a .venv made before this fix is mended too.
outer=""
if [ -n "$offline" ]; then
  outer="$("$py" -c 'import site, sys; print("".join(f"; site.addsitedir({p!r})" for p in site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')"
fi
if [ ! -x "$venv/bin/python" ]; then
  say "creating the virtual environment $venv"
  if [ -n "$outer" ]; then
    "$py" -m venv --system-site-packages --without-pip "$venv"
  elif [ -n "$offline" ]; then
    "$py" -m venv --system-site-packages "$venv"
  else
    "$py" -m venv "$venv"
  fi
fi
if [ -n "$outer" ]; then
  inner="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  printf 'import site%s\n' "$outer" >"$inner/_xorl_outer_venv.pth"
fi
# torch's console scripts live beside the interpreter that installed torch, not in this venv; the
# tests and scripts run "$venv/bin/torchrun", so it runs torch's launcher with this venv's python.
if [ -n "$offline" ] && [ ! -e "$venv/bin/torchrun" ]; then
  printf '#!/bin/sh\nexec "%s" -m torch.distributed.run "$@"\n' "$venv/bin/python" >"$venv/bin/torchrun"
  chmod +x "$venv/bin/torchrun"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"

# Reinstall when the project's install recipe changed since the last install.
want="$(cat "$root/pyproject.toml" "$root/setup.py" "$root/CMakeLists.txt" "$root"/csrc/* 2>/dev/null | sha1sum | cut -c1-40)"
have="$(cat "$stamp" 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
  started=$SECONDS
  if [ -n "$offline" ]; then
    say "installing xorl into $venv from $root, offline, with the preinstalled torch (building the CUDA extension can take a few minutes)"
    python -m pip install -q --no-index --no-build-isolation --no-deps -e "$root"
  else
    say "updating pip"
    python -m pip install -q --upgrade pip
    if ! python -c "import torch" 2>/dev/null; then
      if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        say "downloading and installing torch (the CUDA build, several GB: often 5-10 minutes)"
        python -m pip install -q torch  # a GPU machine with a registry: the default CUDA build
      else
        say "downloading and installing torch ${XORL_CPU_TORCH:-2.13.0} (the CPU build, about 200 MB: a few minutes)"
        python -m pip install -q "torch==${XORL_CPU_TORCH:-2.13.0}"
      fi
    fi
    say "installing xorl and its test dependencies (pip install -e .[test]; builds the CUDA extension where nvcc exists)"
    python -m pip install -q -e "$root[test]"
  fi
  echo "$want" >"$stamp"
  say "done in $((SECONDS - started)) s; later runs reuse $venv until pyproject.toml, setup.py or csrc/ change"
fi
