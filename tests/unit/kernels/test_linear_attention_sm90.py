"""The linear-attention Triton kernels compile for an H100 and fit its shared memory, checked on CPU.

tests/support/sm90_compile.py compiles every gated delta, short conv and gated norm kernel for sm_90
(Triton's pipeline and ptxas, no GPU needed) with the block sizes and launch options the ops use at
d_k = d_v = 128, in bf16 and fp32. The interpreter that runs the numerical tests on CPU accepts code
compiled Triton refuses and never sees shared memory; this is where both show without a GPU (it
caught a loop-carried pointer changing type, and 64-token chunks asking for 232 KiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_kernel_compiles_for_sm90_within_shared_memory():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "tests.support.sm90_compile"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1400)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    from tests.support.sm90_compile import SHARED_LIMIT

    failed = {name: v for name, v in report.items() if not isinstance(v, int)}
    assert not failed, failed
    over = {name: v for name, v in report.items() if v > SHARED_LIMIT}
    assert not over, f"over {SHARED_LIMIT} bytes of shared memory: {over}"
    assert len(report) == 24  # 12 kernels x (bf16, fp32)
