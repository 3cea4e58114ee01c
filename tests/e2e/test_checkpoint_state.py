"""Checkpoints on a disk that fills and with a flipped byte (xorl/checkpoint/state.py) through the real
`xorl-train`: named before the save, nothing partial left, and the suggested resume works."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.support.cli_runs import write_config, xorl_train
from xorl.observability.metrics import read_metrics

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for process ids")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1.6 MB tmpfs: one checkpoint of the tiny model (about 1 MB) fits, a second does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_named_before_the_save_and_stale_saves_are_removed_on_resume(tmp_path, tiny_disk):
    config = write_config(tmp_path, str(tiny_disk / "out"), max_steps=6, save_steps=2)
    run = xorl_train(config, cwd=tmp_path, timeout=300)
    assert run.code == 1 and "Traceback" not in run.text, run.text
    root = tiny_disk / "out" / "checkpoints"
    lines = [line for line in run.err.splitlines() if f"no space left on {root}:" in line]
    assert len(lines) == 1, run.err
    needed = int(lines[0].split(": ")[2].split(" bytes needed")[0])
    free = int(lines[0].split("bytes needed, ")[1].split(" free")[0])
    assert needed > free
    assert needed == sum(e["bytes"] for e in json.loads((root / "step_00000002" / "manifest.json").read_text())
                         .values())
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"]  # no partial folder left
    assert [r["step"] for r in read_metrics(tiny_disk / "out" / "metrics.jsonl")] == [1, 2, 3, 4]

    # A save that died half-way (kill -9, ...) leaves step_N.tmp: removed on resume (on a disk with room).
    copy = tmp_path / "copy"
    shutil.copytree(tiny_disk / "out", copy)
    stale = copy / "checkpoints" / "step_00000004.tmp"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(os.urandom(1000))
    resumed = xorl_train(config, "--train.resume=true", f"--train.output_dir={copy}", cwd=tmp_path, timeout=300)
    assert resumed.code == 0, resumed.text
    assert f"xorl: removed step_00000004.tmp from {copy / 'checkpoints'}: saves that did not finish" in resumed.out
    assert not stale.exists()
    assert [r["step"] for r in read_metrics(copy / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_flipped_byte_is_refused_and_the_suggested_resume_works(tmp_path):
    config = write_config(tmp_path, "out", max_steps=4, save_steps=2)
    assert xorl_train(config, cwd=tmp_path).code == 0
    root = tmp_path / "out" / "checkpoints"
    shard = root / "step_00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of a weight, same size
    shard.write_bytes(bytes(data))
    more = ["--train.resume=true", "--train.max_steps=6", "--train.resume_hparams=config"]
    damaged = xorl_train(config, *more, cwd=tmp_path, timeout=300)
    assert damaged.code == 1 and "Traceback" not in damaged.text, damaged.text
    assert damaged.err.count("cannot load checkpoint out/checkpoints/step_00000004: damaged bytes: CRC-32 ") == 1
    assert "was written (reading out/checkpoints/step_00000004/__0_0.distcp)" in damaged.err, damaged.err
    hint = "--train.resume=out/checkpoints/step_00000002 --train.discard_later=true"
    assert hint in damaged.err, damaged.err

    # The suggestion without discard_later is refused (a later step exists), and says how.
    plain = xorl_train(config, *more[1:], "--train.resume=out/checkpoints/step_00000002", cwd=tmp_path)
    assert plain.code == 2 and "--train.discard_later=true" in plain.err, plain.err
    # The suggestion as given works: step 4 is moved aside, not deleted, and the run goes on from step 2.
    resumed = xorl_train(config, *more[1:], *hint.split(), cwd=tmp_path, timeout=300)
    assert resumed.code == 0, resumed.text
    assert (root / "discarded" / "step_00000004" / "__0_0.distcp").read_bytes() == bytes(data)
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert (root / "latest").read_text().strip() == "step_00000006"

    # A damaged small file is found before start-up.
    state = root / "step_00000006" / "trainer_state.json"
    text = state.read_text()
    state.write_text(text.replace('"step": 6', '"step": 5'))
    refused = xorl_train(config, "--train.resume=true", "--train.max_steps=8", "--train.resume_hparams=config",
                         cwd=tmp_path)
    assert refused.code == 2, refused.text
    assert "checkpoint file out/checkpoints/step_00000006/trainer_state.json is damaged" in refused.err
