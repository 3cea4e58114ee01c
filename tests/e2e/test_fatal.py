"""A fatal error or a stall on one rank ends the whole job (xorl/run/fatal.py): the real `torchrun`, a
tiny model, output read from the log. Each asserts the exit code, the one message, that nothing
earlier is lost, and that the job ends within collective_timeout_s and a margin."""

from __future__ import annotations

import os

import pytest

from tests.e2e.test_cli_runs import _our_frames
from tests.support.cli_runs import torchrun_command
from tests.support.fault_runs import Job, seconds_after_last_step, stream_config, worker_hook
from xorl.observability.metrics import read_metrics

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for process ids")


TIMEOUT_S = 20  # train.collective_timeout_s of the multi-rank cases
MARGIN_S = 30


FAIL_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":  # a worker (torchrun itself has no RANK)
    import xorl.data.stream as stream
    from xorl.data.corpus import DataError
    original = stream.StreamedLoader.microbatches
    def microbatches(self, step):
        if step == 6:
            raise DataError("planted: rank 1 cannot read its data at step 7")
        return original(self, step)
    stream.StreamedLoader.microbatches = microbatches
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["every rank", "rank 1 only"])
def test_a_data_error_ends_the_job_with_one_message(tmp_path, where):
    """A malformed row every rank reaches (streamed data: each rank reads the stream), or a planted
    error on rank 1 alone: the message once, from the rank that had it, and the job ends promptly."""
    config = stream_config(tmp_path, rows=200, bad_at=30 if where == "every rank" else None, max_steps=500,
                            save_steps=3, collective_timeout_s=TIMEOUT_S, heartbeat_s=5,
                            data_parallel_shard_size=2)
    extra = worker_hook(tmp_path, FAIL_ON_RANK_1) if where == "rank 1 only" else {}
    job = Job(torchrun_command(2, config), tmp_path, extra)
    job.wait_for("step 3/")
    code = job.finish(limit_s=240)
    text = job.text
    assert code != 0
    assert seconds_after_last_step(job) < TIMEOUT_S + MARGIN_S, (seconds_after_last_step(job), text)
    if where == "every rank":
        message = "data.jsonl:31: not valid JSON"  # the malformed row is line 31
        assert text.count(message) == 1, text
        assert f"xorl-train (rank 0): {message}" in text or f"xorl-train (rank 1): {message}" in text
    else:
        message = "planted: rank 1 cannot read its data at step 7"
        assert text.count(message) == 1, text
        assert f"xorl-train (rank 1): {message}" in text, text
    assert "exitcode  : 2" in text  # the data error's code, in torchrun's summary
    # nothing earlier lost: every logged step once, and the checkpoints saved before it are complete
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    latest = (tmp_path / "out" / "checkpoints" / "latest").read_text().strip()
    assert (tmp_path / "out" / "checkpoints" / latest / "manifest.json").is_file()


STALL_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":  # rank 1 stops answering at step 7 (a hung read, a stuck device)
    import time
    import xorl.data.stream as stream
    original = stream.StreamedLoader.microbatches
    def microbatches(self, step):
        if step == 6:
            time.sleep(3600)
        return original(self, step)
    stream.StreamedLoader.microbatches = microbatches
"""


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_within_the_collective_timeout(tmp_path):
    """Rank 1 stalls: rank 0's collective times out (its one clean line), torchrun then stops rank 1
    with SIGTERM, and rank 1 exits at once, not as a preemption waiting for torchrun's SIGKILL 30 s
    later (before: the job ended collective_timeout_s + 30 s after the stall, rank 1 killed by -9)."""
    config = stream_config(tmp_path, rows=400, bad_at=None, max_steps=500, save_steps=0,
                            collective_timeout_s=TIMEOUT_S, heartbeat_s=5, data_parallel_shard_size=2)
    extra = worker_hook(tmp_path, STALL_ON_RANK_1)
    job = Job(torchrun_command(2, config), tmp_path, extra)
    job.wait_for("step 6/")
    code = job.finish(limit_s=240)
    text = job.text
    assert code != 0
    assert seconds_after_last_step(job) < TIMEOUT_S + 15, (seconds_after_last_step(job), text)
    assert "SIGKILL" not in text and "SIGTERM received" not in text, text  # torchrun's stop is not a preemption
    message = f"did not complete within train.collective_timeout_s={TIMEOUT_S} s"
    assert text.count(message) == 1 and f"xorl-train (rank 0): a collective {message}" in text, text
    assert _our_frames(text) == [], text  # torchrun's own stack only, no traceback of ours
