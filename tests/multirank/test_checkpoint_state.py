"""Saves that fail (xorl/checkpoint/state.py): a crash keeps the last good checkpoint, and a disk that
fills in the shards or in the small files is named on every rank with nothing partial left."""

from __future__ import annotations

import errno
import os

import pytest

import xorl.checkpoint.state as ckpt
from tests.support.parity_runs import tiny_config, train_losses


def test_a_crash_during_save_keeps_the_last_good_checkpoint(gloo_world, tmp_path, monkeypatch):
    world = gloo_world(1)
    run = str(tmp_path / "run")
    world.run(train_losses, tiny_config(run, max_steps=4, save_steps=2), 2)
    good = ckpt.latest_checkpoint(run)
    files_before = sorted(os.listdir(good))

    def crash(*args, **kwargs):
        raise OSError("disk full (planted)")

    monkeypatch.setattr(ckpt.dcp, "save", crash)
    import torch.distributed as dist

    from xorl.distributed.init import init_distributed

    os.environ.update(MASTER_PORT="29777")
    init_distributed()
    try:
        with pytest.raises(OSError, match="planted"):
            ckpt.save_checkpoint(run, 4, [], [], {"step": 4})
    finally:
        dist.destroy_process_group()
    assert ckpt.latest_checkpoint(run) == good
    assert sorted(os.listdir(good)) == files_before


def _save_with_disk_full_midway(output_dir: str) -> str:
    """One process: a Checkpointer save whose file writes fail with ENOSPC after 64 KiB."""
    import torch

    import xorl.checkpoint.files as files
    from xorl.checkpoint.state import Checkpointer, CheckpointError

    real = files.RecordingFileSystem.create_stream

    class Full:
        def __init__(self, raw):
            self.raw, self.n = raw, 0

        def write(self, data):
            self.n += len(memoryview(data).cast("B"))
            if self.n > 65536:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    def create_stream(self, path, mode):
        cm = real(self, path, mode)
        if "w" in mode:
            stream = cm.__enter__()
            stream._raw = Full(stream._raw)
            return _Reentered(cm, stream)
        return cm

    files.RecordingFileSystem.create_stream = create_stream
    try:
        model = torch.nn.Linear(256, 256)
        optim = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 256)).sum().backward()
        optim.step()
        try:
            Checkpointer(output_dir).save(1, [model], [optim], {"step": 1}, blocking=True)
        except CheckpointError as e:
            return str(e)
        return "saved"
    finally:
        files.RecordingFileSystem.create_stream = real


class _Reentered:
    def __init__(self, cm, stream):
        self.cm, self.stream = cm, stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


def test_enospc_in_the_middle_of_a_write_is_named(gloo_world, tmp_path):
    out = str(tmp_path / "out")
    message = gloo_world(1).run(_save_with_disk_full_midway, out)[0]
    root = os.path.join(out, "checkpoints")
    assert message.startswith(f"no space left on {root}: "), message
    needed = int(message.split(": ")[1].split(" bytes needed")[0])
    assert needed >= 3 * (256 * 256 + 256) * 4  # the weights and AdamW's two moments: the state's size
    assert "free; checkpoint step_00000001 was not written and no earlier checkpoint exists" in message
    assert not os.path.exists(os.path.join(root, "step_00000001.tmp"))
    assert not os.path.exists(os.path.join(root, "latest"))


def _save_with_disk_full_in_the_small_files(output_dir: str, blocking: bool) -> tuple[str, str]:
    """Every rank's shards are written; then rank 0's plain files meet ENOSPC (the disk filled with the
    last bytes, seen on a 1.1 MB tmpfs under torchrun: an OSError traceback, step_N.tmp left)."""
    import torch

    import xorl.checkpoint.state as checkpoint
    from xorl.checkpoint.state import Checkpointer, CheckpointError

    real = checkpoint._write_files

    def write_files(folder, files, records):
        with open(os.path.join(folder, "run_config.yaml"), "wb") as f:
            f.write(b"train: {}\n")  # a first file lands, the next does not
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(folder, "trainer_state.json"))

    checkpoint._write_files = write_files
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        optim = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 64)).sum().backward()
        optim.step()
        saver = Checkpointer(output_dir)
        try:
            saver.save(3, [model], [optim], {"step": 3}, {"run_config.yaml": "x"}, blocking=blocking)
            saver.wait()
        except CheckpointError as e:
            return type(e).__name__, str(e)
        return "saved", ""
    finally:
        checkpoint._write_files = real


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_disk_that_fills_with_the_small_files_is_named_on_every_rank(gloo_world, tmp_path, blocking):
    out = str(tmp_path / f"out_{blocking}")
    results = gloo_world(2).run(_save_with_disk_full_in_the_small_files, out, blocking, timeout_s=120)
    root = os.path.join(out, "checkpoints")
    for kind, message in results:  # the same CheckpointError on both ranks (rank 1 wrote nothing itself)
        assert kind == "CheckpointError", (kind, message)
        assert message.startswith(f"no space left on {root}: "), message
        assert "checkpoint step_00000003 was not written and no earlier checkpoint exists" in message
    assert sorted(os.listdir(root)) == []  # neither step_00000003.tmp nor a half-published step_00000003
