"""The run a user starts from the command line: refused before starting when it cannot work,
resumed exactly, never mixed with another run, readable in a log. Every check drives the real
`xorl-train` / `torchrun -m xorl.cli.train` / `scripts/train.sh` on a tiny model."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
import yaml

import xorl
import xorl_kernels
from tests.support.cli_runs import (
    ROOT,
    alive,
    children,
    env,
    rank_of,
    torchrun,
    torchrun_command,
    write_config,
    xorl_train,
)
from xorl.observability.metrics import read_metrics
from xorl.trainer.optim import lr_factor

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for process ids")]


def _no_traceback(text: str) -> bool:
    return "Traceback" not in text


PACKAGE_DIRS = tuple(os.path.dirname(os.path.realpath(m.__file__)) + os.sep for m in (xorl, xorl_kernels))


def _our_frames(text: str) -> list[str]:
    """The traceback frames (``File "PATH", line N``) in xorl's own code. By path, not by the text
    'xorl/': a clone folder named xorl puts that in torchrun's own frames (.../xorl/.venv/...)."""
    frames = re.findall(r'File "([^"]+)", line \d+', text)
    return [f for f in frames if os.path.realpath(f).startswith(PACKAGE_DIRS)]


def test_our_frames_are_told_apart_from_torchrun_frames_in_a_clone_named_xorl():
    # torchrun's stack in a clone at /home/user/xorl (git's default folder name) with its venv inside.
    torchrun_trace = ('Traceback (most recent call last):\n  File "/home/user/xorl/.venv/lib/python3.11/site-packages/'
                      'torch/distributed/run.py", line 892, in main\n    run(args)\n')
    assert "xorl/" in torchrun_trace  # what the old check matched
    assert _our_frames(torchrun_trace) == []
    ours = f'{torchrun_trace}  File "{PACKAGE_DIRS[0]}cli/train.py", line 40, in main\n'
    assert _our_frames(ours) == [f"{PACKAGE_DIRS[0]}cli/train.py"]


def test_a_run_folder_from_start_to_resume_to_overwrite(tmp_path):
    config = write_config(tmp_path, "out")
    metrics = tmp_path / "out" / "metrics.jsonl"

    # A first run, logged for a non-terminal: summary, a line a step, a line a checkpoint. Asked to
    # resume with no checkpoint there yet, it says it starts from scratch.
    first = xorl_train(config, "--train.resume=true", cwd=tmp_path)
    assert first.code == 0, first.text
    assert "train.resume=true: no checkpoint in out/checkpoints; starting from step 0" in first.out
    for phrase in ("llama model, 0.04M parameters", "world size 1 = one process",
                   "1 sequences x 32 tokens = 32 tokens a step", "steps 0 -> 4"):
        assert phrase in first.out, first.out
    assert [line.split()[1] for line in first.out.splitlines() if line.startswith("step ")] == \
        ["1/4", "2/4", "3/4", "4/4"]
    # step 2 in the background, step 4 (the last) blocking
    assert "xorl: saving checkpoint out/checkpoints/step_00000002 (in the background)" in first.out, first.out
    assert "xorl: saved checkpoint out/checkpoints/step_00000004" in first.out, first.out
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the console's steps, the checkpoints' names

    # The same command again would mix two runs: refused, once, exit 2, nothing touched.
    again = xorl_train(config, cwd=tmp_path)
    assert again.code == 2 and _no_traceback(again.text)
    assert again.err.count("already holds checkpoints, config.yaml, metrics.jsonl") == 1
    assert "--train.resume=true" in again.err and "--train.overwrite_output_dir=true" in again.err
    assert read_metrics(metrics) == rows

    # Resuming a finished run says so.
    done = xorl_train(config, "--train.resume=true", cwd=tmp_path)
    assert done.code == 0 and "the run is finished" in done.out and "at step 4" in done.out

    # Changed optimizer / schedule settings: refused, listing each, until the user says which win.
    changed = ["--train.resume=true", "--train.max_steps=6", "--train.lr=0.02", "--train.weight_decay=0.5"]
    refused = xorl_train(config, *changed, cwd=tmp_path)
    assert refused.code == 2 and _no_traceback(refused.text)
    for phrase in ("train.lr 0.01 -> 0.02", "train.max_steps 4 -> 6", "train.weight_decay 0.1 -> 0.5",
                   "--train.resume_hparams=config"):
        assert refused.err.count(phrase) == 1, refused.err
    resumed = xorl_train(config, *changed, "--train.resume_hparams=config", cwd=tmp_path)
    assert resumed.code == 0, resumed.text
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # each step once
    times = [r["time"] for r in rows]
    assert times == sorted(times) and times[4] >= times[3]  # cumulative across the restart
    for row in rows[4:]:  # the new lr and schedule (warmup 1, cosine to 0.1 x lr over 6 steps)
        assert row["lr"] == pytest.approx(0.02 * lr_factor(row["step"] - 1, 1, 6, 0.1), rel=1e-12)
    state = json.loads((tmp_path / "out" / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["consumed_sequences"] == 6

    # Overwrite: the earlier run's files are gone, not mixed in.
    fresh = xorl_train(write_config(tmp_path, "out", max_steps=2), "--train.overwrite_output_dir=true",
                       cwd=tmp_path)
    assert fresh.code == 0, fresh.text
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["latest", "step_00000002"]
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2]

    # A checkpoint that cannot load names the file: damaged bytes (found by DCP), a short file (up front).
    shard = tmp_path / "out" / "checkpoints" / "step_00000002" / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(b"\x01" * size)
    longer = ["--train.resume=true", "--train.max_steps=3", "--train.resume_hparams=config"]
    damaged = xorl_train(config, *longer, cwd=tmp_path)
    assert damaged.code == 1 and _no_traceback(damaged.text), damaged.text
    assert "cannot load checkpoint out/checkpoints/step_00000002" in damaged.err
    assert "(reading out/checkpoints/step_00000002/__0_0.distcp)" in damaged.err
    shard.write_bytes(b"\x01" * (size // 2))
    short = xorl_train(config, *longer, cwd=tmp_path)
    assert short.code == 2 and f"__0_0.distcp has {size // 2} bytes, {size} were written" in short.err


def test_config_errors_are_one_message_with_exit_code_2(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    typos = ["--train.lr=fast", "--train.max_steps=x", "--model.hiden_size=8"]

    # The README's main command checks before torchrun starts: one message, no traceback.
    script = subprocess.run(["bash", os.path.join(ROOT, "scripts", "train.sh"), *typos], cwd=ROOT, env=env(),
                            capture_output=True, text=True, timeout=300)
    assert script.returncode == 2 and _no_traceback(script.stdout + script.stderr)
    assert "invalid config (3 problems)" in script.stderr
    for phrase in ("train.lr: expected float", "train.max_steps: expected int", "did you mean 'hidden_size'?"):
        assert script.stderr.count(phrase) == 1, script.stderr

    # torchrun directly: the message once (rank 0), and it is torchrun's root cause; no xorl traceback.
    launched = torchrun(2, str(tmp_path / "empty.yaml"), *typos, cwd=tmp_path)
    assert launched.code != 0
    assert launched.text.count("train.lr: expected float") == 1, launched.text
    assert "exitcode  : 2" in launched.text
    assert "traceback : invalid config (3 problems) (printed in full above by rank 0)" in launched.text
    assert _our_frames(launched.text) == []  # torchrun's own stack only, none of ours

    # An empty YAML runs on the defaults, and says so.
    check = xorl_train(str(tmp_path / "empty.yaml"), "--check", cwd=tmp_path)
    assert check.code == 0 and "sets no field; training with the defaults" in check.out


def test_a_hugging_face_folder_defines_the_model_and_bad_data_names_its_line(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                                  rms_norm_eps=1e-5, max_position_embeddings=64)
    transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "llama")
    config = write_config(tmp_path, "out", max_steps=1, save_steps=0)
    conflict = xorl_train(config, "--model.model_path=llama", "--model.rope_theta=10000", cwd=tmp_path)
    assert conflict.code == 2 and _no_traceback(conflict.text)
    assert "model.rope_theta=10000.0 (set by --model.rope_theta=10000) conflicts with rope_theta=500000.0" \
        in conflict.err
    run = xorl_train(config, "--model.model_path=llama", cwd=tmp_path)
    assert run.code == 0, run.text
    used = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["model"]
    assert (used["rope_theta"], used["rms_norm_eps"], used["max_position_embeddings"]) == (500000.0, 1e-5, 64)

    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three", oops}\n')
    bad = xorl_train(config, "--data.dataset=bad.jsonl", "--train.output_dir=bad_out", cwd=tmp_path)
    assert bad.code == 2 and _no_traceback(bad.text)
    assert bad.err.count("bad.jsonl:3: not valid JSON") == 1, bad.err


def test_resuming_on_more_ranks_continues_at_the_next_unseen_sequence(tmp_path):
    """2 ranks x 2 microbatches for 3 steps (12 sequences), then 4 ranks: 8 a step from sequence 12."""
    config = write_config(tmp_path, "out", max_steps=3, save_steps=3, data_parallel_shard_size=-1,
                          gradient_accumulation_steps=2)
    first = torchrun(2, config, cwd=tmp_path)
    assert first.code == 0, first.text
    more = torchrun(4, config, "--train.resume=true", "--train.max_steps=5", "--train.resume_hparams=config",
                    cwd=tmp_path)
    assert more.code == 0, more.text
    assert "the global batch changed from 4 to 8 sequences a step; the data continues at sequence 12" in more.out
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    state = json.loads((tmp_path / "out" / "checkpoints" / "step_00000005" / "trainer_state.json").read_text())
    assert (state["consumed_sequences"], state["global_batch"], state["world_size"]) == (12 + 2 * 8, 8, 4)


def test_a_stalled_rank_gets_a_heartbeat_and_ends_at_the_timeout(tmp_path):
    """Rank 1 is stopped (SIGSTOP) after step 2: rank 0 prints heartbeat lines while it waits, and
    fails at train.collective_timeout_s instead of hanging."""
    timeout_s = 15
    config = write_config(tmp_path, "out", max_steps=10_000, save_steps=0, collective_timeout_s=timeout_s,
                          heartbeat_s=2)
    proc = subprocess.Popen(torchrun_command(2, config), cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    workers, stopped = [], None
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("step 2/") for line in list(lines)) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        workers = children(proc.pid)
        ranks = {rank_of(pid): pid for pid in workers}
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        # Generous on a loaded machine; that the collective timeout (not anything else) ended it is
        # what the output says below, never a reading of the clock.
        while alive(ranks[0]) and time.monotonic() - start < timeout_s + 60:
            time.sleep(0.2)
        assert not alive(ranks[0]), "rank 0 still waits after the collective timeout"
    finally:
        for pid in workers:  # torchrun would wait 30 s for the stopped rank to take its SIGTERM
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    text = "".join(lines)
    assert proc.returncode != 0
    assert "still running after" in text and f"train.collective_timeout_s={timeout_s} s" in text, text


def test_workers_exit_when_the_launcher_is_killed(tmp_path):
    config = write_config(tmp_path, "out", max_steps=10_000, save_steps=0)
    proc = subprocess.Popen(torchrun_command(1, config), cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    workers = []
    try:
        for line in proc.stdout:
            if line.startswith("step 1/"):
                workers = children(proc.pid)
                break
        assert workers and all(alive(pid) for pid in workers)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only, not its process group
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in workers)
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_one_process_on_a_busy_master_port_trains_saves_the_last_step_and_then_is_finished(tmp_path):
    """A busy MASTER_PORT, save_steps 0, log_steps 2, a warmup longer than the run: it trains, says
    so, saves the last step, and `resume: true` then finds the run finished."""
    config = write_config(tmp_path, "out", max_steps=4, save_steps=0, log_steps=2, warmup_steps=10)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        os.environ["MASTER_PORT"] = str(busy.getsockname()[1])  # xorl_train passes os.environ on
        try:
            run = xorl_train(config, cwd=tmp_path)
        finally:
            del os.environ["MASTER_PORT"]
    assert run.code == 0, run.text
    assert "train.warmup_steps=10 is more than train.max_steps=4: warming up over 4 steps" in run.out
    assert [ln.split()[1] for ln in run.out.splitlines() if ln.startswith("step ")] == ["2/4", "4/4"]
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert "xorl: saved checkpoint out/checkpoints/step_00000004" in run.out
    again = xorl_train(config, "--train.resume=true", cwd=tmp_path)
    assert again.code == 0 and "the run is finished" in again.out, again.text
