"""Issue 26, items 7-16: the faults and traps of a first hour with xorl, each checked the way a user
meets it where that is cheap (in-process), and through the real command line (marked slow)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from tests.support.cli_runs import ROOT, write_config, xorl_train
from tests.support.parity_runs import tiny_config, train_with_nan_at
from xorl.config import (
    Config,
    ConfigError,
    DataConfig,
    TrainConfig,
    compute_dtype,
    config_help,
    field_docs,
    load_config,
)
from xorl.config.model_path import weight_file_problems
from xorl.distributed.parallel_config import ParallelConfig
from xorl.observability.metrics import MetricsLogger, read_metrics, startup_summary
from xorl.run.preflight import prepare_run
from xorl.trainer.optim import lr_factor

FSDP2 = dict(data_parallel_shard_size=2, gradient_accumulation_steps=2)


# -- 7. model_path: weight files checked up front, non-finite loss explained ---------------------------
def _weights(folder, shards: int = 1) -> dict[str, torch.Tensor]:
    """A folder of random tensors as safetensors (one file, or ``shards`` files and an index)."""
    gen = torch.Generator().manual_seed(7)
    tensors = {f"model.layers.{i}.w": torch.randn(4, 8, generator=gen) for i in range(4)}
    os.makedirs(folder, exist_ok=True)
    if shards == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        return tensors
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(folder, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return tensors


def test_damaged_or_missing_weight_files_are_named(tmp_path):
    one, sharded = str(tmp_path / "one"), str(tmp_path / "sharded")
    _weights(one)
    _weights(sharded, shards=2)
    assert weight_file_problems(one) == [] and weight_file_problems(sharded) == []

    single = os.path.join(one, "model.safetensors")
    size = os.path.getsize(single)
    os.truncate(single, size - 10)  # a copy cut short in the data
    [problem] = weight_file_problems(one)
    assert f"{single} has {size - 10} bytes, its header describes {size}" in problem
    os.truncate(single, 20)  # cut short inside the header
    [problem] = weight_file_problems(one)
    assert single in problem and "its header alone needs" in problem

    second = os.path.join(sharded, "model-00002-of-00002.safetensors")
    os.remove(second)
    [problem] = weight_file_problems(sharded)
    assert f"{second} is missing (model.safetensors.index.json lists it)" in problem
    save_file({"other": torch.randn(2)}, second)  # a file of another model under the right name
    [problem] = weight_file_problems(sharded)
    assert "places 2 tensors in model-00002-of-00002.safetensors that it does not hold" in problem


def _hf_llama(folder, nan_in: str | None = None, layers: int = 4) -> None:
    """A transformers Llama of tiny_config's shape (tests/support/cli_runs.py's: 2 layers); ``nan_in``: one NaN
    planted in that tensor."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                  max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf).save_pretrained(folder)
    if nan_in is not None:
        path = os.path.join(folder, "model.safetensors")
        tensors = load_file(path)
        tensors[nan_in][1, 2] = float("nan")
        save_file(tensors, path, metadata={"format": "pt"})


def train_until_it_stops(config: Config) -> str:
    """Run the trainer; return the message of the NonFiniteLossError it stops with (ranks' check)."""
    from xorl.trainer.step import NonFiniteLossError
    from xorl.trainer.trainer import Trainer

    trainer = Trainer(config)
    try:
        trainer.train()
    except NonFiniteLossError as err:
        return str(err)
    raise AssertionError("the trainer did not stop on a non-finite loss")


def test_a_nan_weight_is_named_at_the_first_step_on_every_rank(gloo_world, tmp_path):
    folder = str(tmp_path / "hf")
    _hf_llama(folder, nan_in="model.layers.2.mlp.down_proj.weight")
    config = tiny_config(str(tmp_path / "out"), max_steps=3, **FSDP2)
    config.model.model_path = folder
    messages = gloo_world(2).run(train_until_it_stops, config)
    for message in messages:
        assert "step 0: loss=nan" in message and "the initial weights are at fault" in message, message
        assert "model.layers.2.mlp.down_proj.weight holds NaN or inf values" in message
        assert f"model.model_path={folder!r}" in message
        assert "last good checkpoint" not in message and "No checkpoint was saved" in message


def test_a_nan_loss_with_finite_weights_blames_the_data_or_names_the_checkpoint(gloo_world, tmp_path):
    world = gloo_world(2)
    first = world.run(train_with_nan_at, tiny_config(str(tmp_path / "a"), max_steps=3, **FSDP2), 0)
    assert all("every initial weight finite" in m and "the first batch of data.dataset='builtin'" in m
               for m in first), first
    later = world.run(train_with_nan_at, tiny_config(str(tmp_path / "b"), max_steps=5, **FSDP2), 2)
    assert all("step 2" in m and "no checkpoint was saved before it" in m for m in later), later
    saved = world.run(train_with_nan_at, tiny_config(str(tmp_path / "c"), max_steps=5, save_steps=2, **FSDP2), 3)
    checkpoint = os.path.join(str(tmp_path / "c"), "checkpoints", "step_00000002")
    assert all(f"the last complete checkpoint is {checkpoint}" in m for m in saved), saved


# -- 8. one process needs no port; YAML duplicates; epochs; streaming lines; parquet -----------------------
def test_duplicate_yaml_keys_are_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 0.1\n  max_steps: 2\n  lr: 0.2\nmodel:\n  hidden_size: 32\nmodel:\n  seed: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert f"{path}:4: key 'train.lr' is set twice (also at line 2)" in message
    assert f"{path}:7: key 'model' is set twice (also at line 5)" in message
    path.write_text("train:\n  lr: 0.1\n  adam_betas: [0.9, 0.99]\ndata:\n  seq_len: 64\n")
    config = load_config(str(path))
    assert (config.train.lr, config.train.adam_betas, config.data.seq_len) == (0.1, (0.9, 0.99), 64)


def _summary(config: Config, device_type: str = "cpu", data_sequences: int | None = None) -> str:
    return startup_summary(config, ParallelConfig.from_config(config, 1), 10_000, 0, device_type, data_sequences)


def test_the_start_up_says_how_many_epochs_and_when_the_data_is_smaller_than_a_step():
    config = Config()
    config.data.micro_batch_size, config.train.gradient_accumulation_steps, config.train.max_steps = 4, 2, 10
    small = _summary(config, data_sequences=3)
    assert "the data packs into 3 sequences; fewer than one step's 8: every step repeats some of them" in small
    assert "10 steps = 26.7 epochs" in small
    assert "fewer than" not in _summary(config, data_sequences=160) and "= 0.5 epochs" in \
        _summary(config, data_sequences=160)
    assert "epochs" not in _summary(config)  # streamed data: the size is not known up front


def test_streaming_errors_name_the_line(tmp_path):
    from xorl.data.corpus import DataError
    from xorl.data.stream import _documents_from

    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": "three", oops}\n{"text": 4}\n')
    with pytest.raises(DataError, match=rf"^{path}:4: not valid JSON"):
        list(_documents_from(str(path), 0, "text", 0))
    path.write_text(path.read_text().replace(", oops", ""))
    resumed_at = len(b'{"text": "one"}\n\n{"text": "two"}\n')  # a checkpoint's stream offset
    with pytest.raises(DataError, match=rf"^{path}:5: 'text' is number"):
        list(_documents_from(str(path), resumed_at, "text", 0))


def test_parquet_errors_are_one_line(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from xorl.data.corpus import DataError, read_documents

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"content": ["a", "b"], "n": [1, 2]}), path)
    with pytest.raises(DataError) as info:
        list(read_documents(str(path), "text"))
    assert str(info.value) == f"{path}: no column 'text' (columns: ['content', 'n']); set data.text_key"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DataError) as info:
        list(read_documents(str(path), "text"))
    assert str(info.value).startswith(f"{path}: cannot read column 'text': ") and "\n" not in str(info.value)


# -- 9, 16. --help; unknown keys ---------------------------------------------------------------------
def test_help_lists_every_key_with_its_default_and_meaning(capsys):
    from xorl.cli.train import main

    for flag in ("--help", "-h"):
        main([flag])  # returns: exit code 0
        out = capsys.readouterr().out
        assert out.startswith("usage: xorl-train") and "\ntrain:\n" in out and "\n  seq_len: 128  (int)" in out
    text = config_help()
    for section, cls in (("data", DataConfig), ("train", TrainConfig)):
        docs = field_docs(cls)
        for name, value in yaml.safe_load(Config().to_yaml())[section].items():
            # every data and train key documented, its default shown as JSON
            assert docs.get(name), f"{section}.{name} has no comment in xorl/config/sections.py"
            line = next(ln for ln in text.splitlines() if ln.startswith(f"  {name}: "))
            assert json.loads(line.split("  (")[0].split(": ", 1)[1]) == value
    assert "  lr: 0.001  (float) peak learning rate" in text


@pytest.mark.parametrize("override, expected", [
    ("--train.learning_rate=1e-3", "unknown key train.learning_rate (did you mean 'lr'?)"),
    ("--train.per_device_train_batch_size=4", "(did you mean data.micro_batch_size?)"),
    ("--data.max_seq_length=512", "unknown key data.max_seq_length (did you mean 'seq_len'?)"),
    ("--train.warmup_step=5", "(did you mean 'warmup_steps'?); `xorl-train --help` lists every key"),
    ("--train.zzz=1", "unknown key train.zzz; `xorl-train --help` lists every key with its default"),
])
def test_unknown_keys_get_the_xorl_name_or_close_matches_not_every_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value)
    assert "the keys of" not in str(info.value) and "collective_timeout_s" not in str(info.value)


# -- 10, 13. the last step is saved; metrics every step; warmup cut to the run ------------------------
def test_metrics_jsonl_gets_every_step_and_the_console_every_log_steps(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), total_steps=4)
    for step in range(4):
        logger.log(step, {"loss": 1.0 / (step + 1)}, elapsed_s=float(step), show=step % 2 == 1)
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [ln.split()[1] for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")] == ["2/4", "4/4"]


def test_a_warmup_longer_than_the_run_is_cut_with_a_line(tmp_path):
    config = load_config(None, ["--train.warmup_steps=10", "--train.max_steps=4",
                                f"--train.output_dir={tmp_path / 'out'}"])
    setup = prepare_run(config, 1)
    assert "train.warmup_steps=10 is more than train.max_steps=4: warming up over 4 steps" in setup.notes
    assert [lr_factor(s, 10, 4, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(2, 3, 10, 0.1) == 1.0  # a warmup within the run is unchanged


# -- 11. the log says the dtype that runs ---------------------------------------------------------------
def test_the_log_says_the_dtype_the_run_computes_in():
    config = Config()
    config.train.dtype = "bfloat16"
    assert compute_dtype(config.train, "cpu") == "float32"
    assert compute_dtype(config.train, "cuda") == "bfloat16"
    assert "float32 on cpu (train.dtype=bfloat16 computes in bf16 on GPU under FSDP2 only)" in _summary(config)
    assert "bfloat16 on cuda" in _summary(config, "cuda")
    config.train.data_parallel_mode = "ddp"
    assert compute_dtype(config.train, "cuda") == "float32"


# -- 12. xorl-plot-metrics ------------------------------------------------------------------------------
def _plot(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "xorl-plot-metrics"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_plot_metrics_reads_a_run_folder_and_refuses_what_it_cannot_plot(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "out"
    run.mkdir()
    rows = [{"step": s, "time": s * 0.5, "loss": 3.0 - s, "lr": 1e-3} for s in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    ok = _plot("out", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.strip() == os.path.join("out", "metrics.png"), ok.stderr
    assert (run / "metrics.png").stat().st_size > 0
    missing = _plot("nothere", cwd=tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip() == ("xorl-plot-metrics: nothere does not exist; pass a run folder "
                                      "(train.output_dir) or its metrics.jsonl")
    unknown = _plot("out", "--keys", "loss", "los", cwd=tmp_path)
    assert unknown.returncode == 2
    assert "has no metric 'los'; its metrics are ['loss', 'lr']" in unknown.stderr

    # the plot is xorl's file: overwrite_output_dir removes it with the run
    (run / "config.yaml").write_text("{}\n")
    config = load_config(None, [f"--train.output_dir={run}", "--train.overwrite_output_dir=true"])
    assert prepare_run(config, 1).overwrite


def test_plot_metrics_x_axis_is_the_rows_step(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from xorl.cli import plot_metrics

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 + s}) + "\n"
                                                    for s in range(1, 4)))
    plotted = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, *a, **k: (plotted.append(list(x)),
                                                                                     original(self, x, y, *a, **k)))
    plot_metrics.main([str(tmp_path), "--keys", "loss"])
    assert plotted == [[1, 2, 3]]  # row 1 (the console's "step 1/3") is the first point


# -- 15. the first set-up says what it does ---------------------------------------------------------------
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


# -- through the real command line ---------------------------------------------------------------------
@pytest.mark.slow
def test_weight_file_faults_are_one_message_before_start(tmp_path):
    _hf_llama(str(tmp_path / "llama"), layers=2)
    single = tmp_path / "llama" / "model.safetensors"
    os.truncate(single, single.stat().st_size // 2)
    config = write_config(tmp_path, "out", max_steps=1)
    run = xorl_train(config, "--model.model_path=llama", cwd=tmp_path)
    assert run.code == 2 and "Traceback" not in run.text, run.text
    assert run.err.count("llama/model.safetensors has") == 1 and "cut short" in run.err
    assert not (tmp_path / "out").exists()  # refused before anything started


@pytest.mark.slow
def test_a_nan_weight_from_the_command_line(tmp_path):
    _hf_llama(str(tmp_path / "llama"), nan_in="model.layers.1.self_attn.q_proj.weight", layers=2)
    config = write_config(tmp_path, "out", max_steps=2)
    run = xorl_train(config, "--model.model_path=llama", cwd=tmp_path)
    assert run.code == 1 and "Traceback" not in run.text, run.text
    assert run.err.count("model.layers.1.self_attn.q_proj.weight holds NaN or inf values") == 1, run.err
    assert "last good checkpoint" not in run.text


@pytest.mark.slow
def test_a_first_hour_run(tmp_path):
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


@pytest.mark.slow
def test_xorl_train_turns_on_expandable_segments_unless_the_user_set_the_allocator():
    # Before torch is imported (the allocator reads its setting once), and never over a user's own.
    probe = ("import os, sys; import xorl.cli.train; "
             "print('torch' in sys.modules, os.environ.get('PYTORCH_ALLOC_CONF'), "
             "os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    for extra, expected in (({}, "False expandable_segments:True None"),
                            ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}, "False max_split_size_mb:64 None"),
                            ({"PYTORCH_CUDA_ALLOC_CONF": "backend:native"}, "False None backend:native")):
        got = subprocess.run([sys.executable, "-c", probe], env={**base, **extra}, capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert got.returncode == 0 and got.stdout.strip() == expected, (extra, got.stdout, got.stderr)
