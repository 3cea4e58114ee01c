"""The run folder's lock (xorl/run/lock.py) between processes: exclusive, released by its holder's death,
and looked at before torch is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.cli_runs import env


@pytest.mark.slow
def test_the_lock_is_exclusive_across_processes_and_released_by_death(tmp_path):
    from xorl.run import lock as run_lock

    out = str(tmp_path / "out")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import time; from xorl.run import lock; assert lock.acquire({out!r}) is None; "
         "print('held', flush=True); time.sleep(600)"], env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        message = run_lock.holder(out)
        assert message is not None and f"pid {holder.pid} on host" in message
        assert run_lock.acquire(out) == message
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert run_lock.holder(out) is None
    try:
        assert run_lock.acquire(out) is None  # the dead run's lock is gone with it
        assert run_lock.acquire(out) is None  # reentrant within one process
        with open(os.path.join(out, ".lock")) as f:
            assert json.load(f)["pid"] == os.getpid()
    finally:
        run_lock.release(out)


@pytest.mark.slow
def test_a_second_run_is_refused_before_torch_is_imported(tmp_path):
    """'refused in a second' (README): the lock is looked at before the config rules, which import the
    model families and torch (measured: the refusal took 25-35 s on a loaded 2-core node, all import)."""
    out = str(tmp_path / "out")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import time; from xorl.run import lock; assert lock.acquire({out!r}) is None; "
         "print('held', flush=True); time.sleep(600)"], env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        probe = subprocess.run([sys.executable, "-c", (
            "import sys\nfrom xorl.config import load_config\nfrom xorl.config.errors import ConfigError\n"
            "from xorl.run.preflight import prepare_run\n"
            f"config = load_config(None, ['--train.output_dir={out}', '--train.resume=true'])\n"
            "try:\n    prepare_run(config, 1)\nexcept ConfigError as e:\n    print('refused:', e)\n"
            "print('torch imported:', 'torch' in sys.modules)\n")], env=env(), capture_output=True, text=True,
            timeout=120)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert f"refused: train.output_dir={out!r} is in use by another run (pid {holder.pid}" in probe.stdout, probe
    assert "torch imported: False" in probe.stdout, probe.stdout + probe.stderr
