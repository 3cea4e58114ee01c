"""The training loop's schedule and length, its logs, profiling, cluster launch and --help.

- every lr_schedule against a float64 formula written here (and hand-computed numbers), at every
  step, through torch's LambdaLR as the trainer builds it;
- train.num_epochs: the step count, each pass a reshuffled permutation of the data (nothing skipped or
  repeated), the epoch columns, and a resume mid-epoch that trains bitwise the same;
- the config errors of the new fields, each one message naming the field and the fix;
- examples/slurm/train.sbatch run with stand-in srun / scontrol / xorl-train: the torchrun it starts.
The W&B / TensorBoard / profiler read-back runs the real command line: tests/e2e/test_train_loop_logs.py.
"""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess

import pytest
import torch
import torch.distributed as dist

from tests.support.cli_runs import ROOT
from tests.support.parity_runs import tiny_config
from xorl.config import Config, TrainConfig, config_help, field_docs, load_config
from xorl.config.errors import ConfigError
from xorl.config.validate import validate_config
from xorl.trainer.optim import build_optimizer, lr_factor


# -- schedules ---------------------------------------------------------------------------------
def expected_factors(schedule: str, warmup: int, total: int, floor: float, fraction: float) -> torch.Tensor:
    """The schedule's multiplier at steps 0..total, float64, written independently of xorl/trainer/optim.py:
    whole-vector torch maths instead of its per-step branches."""
    s = torch.arange(total + 1, dtype=torch.float64)
    w = min(warmup, total)
    start = max(w, total - max(1, round(fraction * total))) if schedule == "wsd" else w
    p = ((s - start) / max(1, total - start)).clamp(0.0, 1.0)
    shape = {"cosine": 0.5 * (1 + torch.cos(math.pi * p)), "linear": 1 - p, "wsd": 1 - p.sqrt(),
             "constant": torch.ones_like(p)}[schedule]
    after = torch.ones_like(p) if schedule == "constant" else floor + (1 - floor) * shape
    out = torch.where(s < start, torch.ones_like(p), after)  # wsd's stable phase
    return torch.where(s < w, (s + 1) / max(w, 1), out)


CASES = [(warmup, total, floor, fraction) for warmup, total, floor, fraction in
         [(0, 1, 0.1, 0.2), (3, 10, 0.1, 0.2), (5, 37, 0.0, 0.3), (10, 7, 0.25, 0.5), (2, 100, 0.05, 0.1),
          (4, 20, 0.1, 1.0), (0, 50, 0.2, 0.04)]]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
@pytest.mark.parametrize("warmup, total, floor, fraction", CASES)
def test_each_schedule_matches_its_float64_formula_at_every_step(schedule, warmup, total, floor, fraction):
    expected = expected_factors(schedule, warmup, total, floor, fraction)
    got = torch.tensor([lr_factor(s, warmup, total, floor, schedule, fraction) for s in range(total + 1)],
                       dtype=torch.float64)
    assert (got - expected).abs().max().item() < 1e-12
    # The trainer's path: build_optimizer's LambdaLR, stepped as train_step steps it.
    train = TrainConfig(lr=3e-3, warmup_steps=warmup, max_steps=total, min_lr_ratio=floor, lr_schedule=schedule,
                        decay_fraction=fraction)
    optimizer, scheduler = build_optimizer([torch.nn.Parameter(torch.randn(4, 3))], train)
    for step in range(total):
        assert scheduler.get_last_lr()[0] == pytest.approx(3e-3 * expected[step].item(), rel=1e-12, abs=1e-18)
        optimizer.step()
        scheduler.step()


def test_wsd_and_linear_by_hand():
    # wsd, 10 steps, warmup 2, the last round(0.3 x 10) = 3 steps decay as 1 - sqrt(progress) to 0.1.
    wsd = [lr_factor(s, 2, 10, 0.1, "wsd", 0.3) for s in range(11)]
    hand = [0.5, 1, 1, 1, 1, 1, 1, 1, 0.1 + 0.9 * (1 - (1 / 3) ** 0.5), 0.1 + 0.9 * (1 - (2 / 3) ** 0.5), 0.1]
    assert wsd == pytest.approx(hand, abs=1e-15)
    linear = [lr_factor(s, 1, 5, 0.0, "linear") for s in range(6)]
    assert linear == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-15)
    assert [lr_factor(s, 2, 6, 0.1, "constant") for s in range(6)] == [0.5, 1, 1, 1, 1, 1]


# -- config errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    (["--train.lr_schedule=cosin"], "train.lr_schedule='cosin' is not one of"),
    (["--train.lr_schedule=constant", "--train.min_lr_ratio=0.05"],
     "train.min_lr_ratio=0.05 has no effect with lr_schedule: constant"),
    (["--train.lr_schedule=wsd", "--train.decay_fraction=0"], "train.decay_fraction=0.0 must be in (0, 1]"),
    (["--train.decay_fraction=0.5"], "train.decay_fraction=0.5 applies to lr_schedule: wsd, not cosine"),
    (["--train.num_epochs=0"], "train.num_epochs=0.0 must be a number > 0"),
    (["--train.num_epochs=2", "--data.streaming=true"], "train.num_epochs needs the data's length"),
    (["--train.wandb_mode=offline"], "train.wandb_mode='offline' has no effect without train.wandb_project"),
    (["--train.wandb_run_name=x"], "train.wandb_run_name='x' has no effect without train.wandb_project"),
    (["--train.profile_steps=[3]"], "train.profile_steps=[3] must be [start, end] with 1 <= start <= end"),
    (["--train.profile_steps=[4, 2]"], "train.profile_steps=[4, 2] must be [start, end]"),
    (["--train.profile_steps=[0, 2]"], "train.profile_steps=[0, 2] must be [start, end]"),
    (["--train.profile_steps=[5, 101]"], "train.profile_steps=[5, 101] ends after train.max_steps=100"),
    (["--train.memory_snapshot_step=0"], "train.memory_snapshot_step=0 must be a step from 1 to train.max_steps=100"),
])
def test_new_fields_are_refused_with_the_field_and_the_fix(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(None, overrides), 1)
    assert expected in str(info.value)


def test_a_missing_logging_package_names_the_extra(monkeypatch):
    import importlib.util

    import xorl.observability.sinks as sinks

    real = importlib.util.find_spec
    monkeypatch.setattr(sinks.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(None, ["--train.wandb_project=p", "--train.tensorboard=true"]), 1)
    assert info.value.problems == [
        "train.wandb_project needs the wandb package, which is not installed; install the logging extra "
        "(pip install -e .[logging], or pip install wandb), or remove train.wandb_project",
        "train.tensorboard needs the tensorboard package, which is not installed; install the logging extra "
        "(pip install -e .[logging], or pip install tensorboard), or remove train.tensorboard"]


def test_a_memory_snapshot_on_cpu_is_refused_before_start_up(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the snapshot is taken there (tests/e2e/test_train_loop_logs.py)")
    from xorl.run.preflight import prepare_run

    config = load_config(None, [f"--train.output_dir={tmp_path / 'out'}", "--train.memory_snapshot_step=2"])
    with pytest.raises(ConfigError) as info:
        prepare_run(config, 1)
    assert "train.memory_snapshot_step=2: a CUDA memory snapshot is GPU-only" in str(info.value)


# -- epochs ----------------------------------------------------------------------------------------
DOCS = 11  # documents shorter than seq_len, packing off: one packed sequence each


def _dataset(tmp_path) -> str:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i:02d} " + "xyz"[i % 3] * (i + 3)}) + "\n"
                            for i in range(DOCS)))
    return str(path)


def _epoch_config(tmp_path, name: str, **train) -> Config:
    train = {"max_steps": TrainConfig().max_steps, "num_epochs": 2.0, **train}
    config = tiny_config(str(tmp_path / name), gradient_accumulation_steps=3, warmup_steps=1, **train)
    config.data.dataset, config.data.packing = _dataset(tmp_path), False
    return config


def test_epoch_steps_cover_every_sequence_and_round_up():
    from xorl.trainer.epochs import epoch_metrics, epoch_steps

    assert epoch_steps(2, 11, 3) == 8  # 22 sequences -> 8 steps of 3 (the last 2 open the third pass)
    assert epoch_steps(1, 12, 4) == 3 and epoch_steps(0.5, 10, 2) == 3 and epoch_steps(0.1, 30, 1) == 3
    assert epoch_steps(2, 11, 6, step=3, consumed=9) == 3 + 3  # resumed at a bigger batch: 13 left
    assert epoch_metrics(3, 11) == {"epoch": 1, "data_seen": 3 / 11}
    assert epoch_metrics(11, 11)["epoch"] == 1 and epoch_metrics(12, 11)["epoch"] == 2


@pytest.mark.parametrize("dp_size", [1, 2])
def test_each_epoch_is_a_fresh_permutation_of_the_data_on_any_layout(tmp_path, dp_size):
    """The loader the trainer reads: each pass holds every sequence once, in a new seeded order, and the
    data-parallel ranks together take exactly the global batch one process takes."""
    from xorl.data.loader import MicrobatchLoader, PackedDataset

    config = _epoch_config(tmp_path, "out")
    dataset = PackedDataset(config.data, vocab_size=config.model.vocab_size)
    assert len(dataset) == DOCS
    index = {tuple(seq.input_ids.tolist()): i for i, seq in enumerate(dataset.sequences)}
    assert len(index) == DOCS

    def seen(dp: int, steps: int, mbs: int, ga: int) -> list[int]:
        loaders = [MicrobatchLoader(dataset, mbs, ga, dp_rank=r, dp_size=dp) for r in range(dp)]
        order = []
        for step in range(steps):
            for m in range(ga):  # global order: microbatch m of rank r holds sequences (m x dp + r) x mbs ...
                for loader in loaders:
                    order += [index[tuple(row.tolist())] for row in loader.microbatches(step)[m]["input_ids"]]
        return order

    order = seen(dp_size, steps=8, mbs=1, ga=6 // dp_size)  # 6 sequences a step, 48 = 4 passes + 4
    assert order == seen(1, steps=8, mbs=1, ga=6)  # the same global batches on every layout
    passes = [order[e * DOCS:(e + 1) * DOCS] for e in range(4)]
    assert all(sorted(p) == list(range(DOCS)) for p in passes)  # nothing skipped, nothing repeated
    assert len({tuple(p) for p in passes}) == 4  # reshuffled every pass
    assert passes == [dataset.order(e) for e in range(4)]  # seed and epoch decide the order
    assert order[4 * DOCS:] == dataset.order(4)[:4]


def _one_process(monkeypatch):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        monkeypatch.setenv(key, value)


def _train_recording(config: Config, monkeypatch, stop_at: int | None = None):
    """Train in this process; return (losses, the packed sequences each step read, max_steps, trainer)."""
    from xorl.trainer.trainer import Trainer

    _one_process(monkeypatch)
    try:
        trainer = Trainer(config)
        read: list[list[tuple]] = []
        microbatches = trainer.loader.microbatches

        def recording(step):
            mbs = microbatches(step)
            read.append([tuple(row.tolist()) for mb in mbs for row in mb["input_ids"]])
            return mbs

        trainer.loader.microbatches = recording
        losses = [r.loss for r in trainer.train(stop_at)]
        return losses, read, config.train.max_steps, trainer
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_num_epochs_sets_the_steps_logs_the_epoch_and_resumes_mid_epoch_bitwise(tmp_path, monkeypatch):
    from xorl.observability.metrics import read_metrics

    full, read, steps, trainer = _train_recording(_epoch_config(tmp_path, "full"), monkeypatch)
    assert steps == 8 and len(full) == 8  # ceil(2 x 11 / 3)
    index = {tuple(seq.input_ids.tolist()): i for i, seq in enumerate(trainer.loader.dataset.sequences)}
    order = [index[row] for step in read for row in step]
    assert sorted(order[:DOCS]) == sorted(order[DOCS:2 * DOCS]) == list(range(DOCS))
    assert order[:DOCS] != order[DOCS:2 * DOCS]
    rows = read_metrics(str(tmp_path / "full" / "metrics.jsonl"))
    assert [(r["epoch"], r["data_seen"]) for r in rows] == [((3 * k - 1) // DOCS + 1, 3 * k / DOCS)
                                                            for k in range(1, 9)]
    for row in rows:  # every row: throughput, utilisation (null on CPU: no peak FLOP/s known), memory
        assert row["tokens_per_s"] > 0 and row["peak_memory_gib"] > 0 and "mfu" in row
    assert json.loads((tmp_path / "full" / "checkpoints" / "step_00000008" / "trainer_state.json").read_text()
                      )["consumed_sequences"] == 24

    # Stopped after step 5 (15 sequences: 4 into the second pass), then resumed from its checkpoint.
    first, read_first, _, _ = _train_recording(_epoch_config(tmp_path, "stopped", save_steps=5), monkeypatch, 5)
    rest, read_rest, steps_again, _ = _train_recording(_epoch_config(tmp_path, "stopped", save_steps=5,
                                                                     resume=True), monkeypatch)
    assert steps_again == 8 and len(rest) == 3
    assert read_first + read_rest == read  # the very sequences, in the same order: none skipped or repeated
    assert first + rest == full  # bitwise


def test_a_stream_logs_its_pass_over_the_files(tmp_path, monkeypatch):
    from xorl.observability.metrics import read_metrics

    config = _epoch_config(tmp_path, "stream", num_epochs=None, max_steps=8)
    config.data.streaming = True
    _train_recording(config, monkeypatch)
    rows = read_metrics(str(tmp_path / "stream" / "metrics.jsonl"))
    assert [r["epoch"] for r in rows] == [(3 * k - 1) // DOCS + 1 for k in range(1, 9)]  # 1, 1, 1, 2, ..., 3
    assert "data_seen" not in rows[0]


def test_num_epochs_with_max_steps_is_one_or_the_other(tmp_path):
    from xorl.run.preflight import prepare_run

    config = _epoch_config(tmp_path, "out")
    config.train.max_steps = 20
    with pytest.raises(ConfigError) as info:
        prepare_run(config, 1)
    assert str(info.value) == ("train.max_steps=20 and train.num_epochs=2 are both set (2 epochs of 11 packed "
                               "sequences at 3 a step = 8 steps); set one of them (--train.num_epochs=null counts "
                               "the run in steps)")
    config.train.max_steps = TrainConfig().max_steps
    setup = prepare_run(config, 1)
    assert config.train.max_steps == 8 and len(setup.dataset) == DOCS
    assert ("train.num_epochs=2: 22 packed sequences (11 in the data) at 3 a step = max_steps 8; the last step's "
            "2 other sequences open the next pass") in setup.notes
    # The run folder's config.yaml records both (max_steps derived): it loads and plans again, and a
    # command-line num_epochs derives max_steps anew; a command-line max_steps beside it is refused.
    path = tmp_path / "again.yaml"
    path.write_text(config.to_yaml())
    assert prepare_run(load_config(str(path)), 1).dataset is not None
    longer = load_config(str(path), ["--train.num_epochs=3"])
    prepare_run(longer, 1)
    assert longer.train.max_steps == 11
    with pytest.raises(ConfigError, match="train.max_steps=9 and train.num_epochs=2 are both set"):
        prepare_run(load_config(str(path), ["--train.max_steps=9"]), 1)
    counted = load_config(str(path), ["--train.max_steps=9", "--train.num_epochs=null"])
    # counted in steps: the data is still read before start-up (xorl/run/preflight.py), but not counted into max_steps
    setup = prepare_run(counted, 1)
    assert counted.train.max_steps == 9 and not any("num_epochs" in note for note in setup.notes)


# -- --help ----------------------------------------------------------------------------------------
def test_help_has_every_key_of_every_section_with_its_default_and_meaning(capsys):
    from xorl.cli.train import main

    main(["--help"])
    out = capsys.readouterr().out
    assert out.endswith(config_help() + "\n")
    from xorl.config import SECTIONS

    sections = out.split("\ntrain:\n")
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for name, value in Config().to_dict()[section].items():
            assert docs.get(name), f"{section}.{name} has no comment in xorl/config/sections.py"
            text = sections[1] if section == "train" else sections[0]
            line = next(ln for ln in text.splitlines() if ln.startswith(f"  {name}: "))
            assert json.loads(line.split("  (")[0].split(": ", 1)[1]) == value and docs[name] in line
    for key in ("lr_schedule", "decay_fraction", "num_epochs", "wandb_project", "wandb_run_name", "wandb_mode",
                "tensorboard", "profile_steps", "memory_snapshot_step"):
        assert f"\n  {key}: " in sections[1]


# -- SLURM -----------------------------------------------------------------------------------------
SBATCH = os.path.join(ROOT, "examples", "slurm", "train.sbatch")


@pytest.mark.slow  # starts processes (bash runs the sbatch script): the full suite's, not the quick tier's
def test_the_sbatch_script_parses_and_runs_torchrun_with_the_job_rendezvous(tmp_path):
    assert subprocess.run(["bash", "-n", SBATCH]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {  # SLURM and xorl stand-ins that record how they were called
        # a long list, as a big job's: a reader that stops at the first line must not fail the script
        "scontrol": 'echo "$@" >> "$LOG/scontrol"; printf "gpu-node-07\\n"; for i in $(seq 8 20000); do '
                    'echo "gpu-node-$i"; done',
        "srun": 'printf "%s\\n" "$@" > "$LOG/srun"',
        "xorl-train": 'printf "%s\\n" "$@" > "$LOG/check"',
    }
    for name, body in stubs.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(tmp_path), "SLURM_NNODES": "3", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu-node-[07-09]", "SLURM_SUBMIT_DIR": str(tmp_path), "GPUS_PER_NODE": "8"}
    done = subprocess.run(["bash", SBATCH, "run.yaml", "--train.lr=3e-4"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "scontrol").read_text().split() == ["show", "hostnames", "gpu-node-[07-09]"]
    assert (tmp_path / "check").read_text().split() == ["run.yaml", "--train.lr=3e-4", "--check", "--world-size=24"]
    srun = (tmp_path / "srun").read_text().split("\n")
    torchrun = srun[srun.index("torchrun"):]
    for arg in ("--nnodes=3", "--nproc_per_node=8", "--rdzv_id=4242", "--rdzv_backend=c10d",
                "--rdzv_endpoint=gpu-node-07:29500"):
        assert arg in torchrun, torchrun
    assert torchrun[-5:-1] == ["-m", "xorl.cli.train", "run.yaml", "--train.lr=3e-4"]
    assert "--ntasks-per-node=1" in srun[:srun.index("torchrun")]


def test_wandb_that_cannot_start_is_one_message(monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb")
    from xorl.observability.sinks import open_sinks

    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    train = TrainConfig(output_dir=str(tmp_path), wandb_project="p", tensorboard=True)
    with pytest.raises(ConfigError) as info:
        open_sinks(train, {}, 0)
    assert str(info.value) == (
        "train.wandb_project='p': W&B could not start a run (UsageError: No API key configured. Use `wandb login` "
        "to log in.); log in (`wandb login` or WANDB_API_KEY), or log offline with --train.wandb_mode=offline")


def test_the_console_line_and_the_bar_show_throughput_mfu_and_memory(tmp_path, monkeypatch, capsys):
    import io
    import sys

    from xorl.observability.metrics import MetricsLogger, format_step_line

    row = {"step": 5, "time": 12.25, "loss": 2.5, "grad_norm": 0.75, "lr": 1e-3, "epoch": 2, "data_seen": 1.25,
           "tokens_per_s": 1234.4, "mfu": 0.4123, "peak_memory_gib": 61.2, "eval_loss": 2.0}
    # An eval step's line carries its eval loss (the progress line shows validation).
    assert format_step_line(row, 10) == ("step 5/10 loss 2.5000 eval_loss 2.0000 grad_norm 0.750 lr 1.00e-03 "
                                            "epoch 2 data_seen 1.250 tokens/s 1234 mfu 41.2% peak_memory_gib 61.20 "
                                            "time 12.2s")
    assert "mfu n/a" in format_step_line({**row, "mfu": None}, 10)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    logger = MetricsLogger(str(tmp_path), total_steps=10, start_step=4)
    metrics = {k: v for k, v in row.items() if k not in ("step", "time")}
    logger.log(4, metrics, elapsed_s=12.25)  # the 5th step (index 4): row step 5
    logger.close()
    assert "tokens/s 1234 mfu 41.2% peak_memory_gib 61.20" in terminal.getvalue()
    from xorl.observability.metrics import read_metrics

    assert read_metrics(str(tmp_path / "metrics.jsonl")) == [row]  # every key, eval metrics too
