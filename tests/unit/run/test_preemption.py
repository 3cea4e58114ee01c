"""PreemptionGuard (xorl/run/preemption.py) in a process of its own: a second signal exits at once."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.support.cli_runs import env


@pytest.mark.slow
def test_a_second_signal_exits_at_once(tmp_path):
    """The first signal sets the flag; the handler restores the default action for the second."""
    code = (
        "import os, signal, time, torch\n"
        "from xorl.run.preemption import PreemptionGuard\n"
        "guard = PreemptionGuard(['SIGUSR1'], 60.0, torch.device('cpu'))\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.2)\n"
        "assert guard.should_stop() == signal.SIGUSR1\n"
        "print('flagged', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(5)\n"
        "print('survived', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    assert "flagged" in proc.stdout and "survived" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGUSR1
    assert "SIGUSR1 received: finishing the current step" in proc.stderr
