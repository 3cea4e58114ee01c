"""The start-up summary and the metrics log (xorl/observability/metrics.py): epochs and a data set
smaller than a step, the dtype that runs, metrics.jsonl every step and the console every log_steps."""

from __future__ import annotations

from xorl.config import Config, compute_dtype
from xorl.distributed.parallel_config import ParallelConfig
from xorl.observability.metrics import MetricsLogger, read_metrics, startup_summary


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


def test_the_log_says_the_dtype_the_run_computes_in():
    config = Config()
    config.train.dtype = "bfloat16"
    assert compute_dtype(config.train, "cpu") == "float32"
    assert compute_dtype(config.train, "cuda") == "bfloat16"
    assert "float32 on cpu (train.dtype=bfloat16 computes in bf16 on GPU under FSDP2 only)" in _summary(config)
    assert "bfloat16 on cuda" in _summary(config, "cuda")
    config.train.data_parallel_mode = "ddp"
    assert compute_dtype(config.train, "cuda") == "float32"


def test_metrics_jsonl_gets_every_step_and_the_console_every_log_steps(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), total_steps=4)
    for step in range(4):
        logger.log(step, {"loss": 1.0 / (step + 1)}, elapsed_s=float(step), show=step % 2 == 1)
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [ln.split()[1] for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")] == ["2/4", "4/4"]
