"""scripts/setup_env.sh: the first set-up says what it does, one line a phase; and its offline way
inside an image whose python3 is itself a venv's.

The GPU image's python3 is /opt/torch/.venv/bin/python3: torch, setuptools and pybind11 live in
that venv. A venv made from it with --system-site-packages sees the base interpreter's packages
only, so before the fix the offline install found no torch and gpu_check.sh stopped at its build.
Here the running interpreter (CI's .venv, or on the GPU machine the .venv setup_env.sh made inside
the image's venv) plays the image's python3.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.slow  # starts processes (a venv, pip, torchrun)
def test_offline_setup_from_a_venv_python_sees_its_torch_and_runs_torchrun(tmp_path):
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(XORL_VENV=str(venv), PYTHON=sys.executable, XORL_OFFLINE="1", XORL_SKIP_CUDA_EXT="1",
               OMP_NUM_THREADS="1")
    setup = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_env.sh")], env=env,
                           capture_output=True, text=True, timeout=300)
    assert setup.returncode == 0, setup.stderr[-3000:]

    probe = "import sys, torch, xorl; print(torch.__file__); print(xorl.__file__); print(sys.prefix)"
    seen = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert seen.returncode == 0, seen.stderr[-3000:]
    torch_file, xorl_file, prefix = seen.stdout.split()
    assert torch_file == torch.__file__  # the outer interpreter's torch, not another
    assert xorl_file == os.path.join(ROOT, "xorl", "__init__.py")  # installed editable from this tree
    assert os.path.realpath(prefix) == os.path.realpath(venv)

    # The tests and gpu_check.sh launch "$venv/bin/torchrun": it must run workers with this venv's python.
    (tmp_path / "worker.py").write_text("import os, sys\nprint('worker', os.environ['RANK'], sys.prefix)\n")
    run = subprocess.run([str(venv / "bin" / "torchrun"), "--standalone", "--nproc_per_node=1", "worker.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"worker 0 {prefix}" in run.stdout, run.stdout


@pytest.mark.slow
def test_the_first_setup_says_what_it_does(tmp_path):
    """setup_env.sh against a stub venv whose python records the pip calls: one line per phase."""
    venv, calls = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "python"
    stub.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\ncase "$*" in *"import torch"*) exit 1;; esac\nexit 0\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    (venv / "bin" / "activate").write_text(f'PATH="{venv / "bin"}:$PATH"\n')
    env = {**os.environ, "XORL_VENV": str(venv), "PYTHON": str(stub)}
    env.pop("XORL_OFFLINE", None)
    script = os.path.join(ROOT, "scripts", "setup_env.sh")
    first = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    phases = [ln for ln in first.stderr.splitlines() if ln.startswith("xorl setup: ")]
    assert [p.split(": ", 1)[1].split(" (")[0].split(" ")[0:2] for p in phases] == [
        ["updating", "pip"], ["downloading", "and"], ["installing", "xorl"], ["done", "in"]], phases
    assert "-q" in calls.read_text()  # pip itself stays quiet
    again = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "xorl setup" not in again.stderr  # installed: nothing to say
