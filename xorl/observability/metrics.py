"""Run logging: a progress bar on terminals, plain lines elsewhere, a JSONL metrics file, and the
sinks the config asks for (TensorBoard, Weights & Biases: xorl/observability/sinks.py).

A row's ``step`` counts the optimizer steps done, from 1: the console line's step, the name of the
checkpoint saved after it (``step_00000020`` holds the state of row 20) and the sinks' step.
metrics.jsonl holds each step once across resumes: a run resumed from checkpoint N first drops the
rows of steps > N (logged after the checkpoint by the run that stopped), and ``time`` is training
time accumulated over every start (the checkpoint carries it). Every row goes to every sink with
all its keys, so a metric added by any caller (eval loss, ...) reaches TensorBoard and W&B too.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tqdm import tqdm

from xorl.run.folder import METRICS_NAME, write_text_atomic


class MetricsLogger:
    """Only the logging rank writes; every other rank gets a no-op logger.

    When stderr is a terminal a tqdm bar shows progress; otherwise (logs, schedulers) every logged
    step is one plain line on stdout, and ``note`` lines (checkpoints saved) go to the same place.
    """

    def __init__(self, output_dir: str, total_steps: int, start_step: int = 0, enabled: bool = True,
                 time_offset: float = 0.0, sinks: list | None = None):
        self.enabled = enabled
        self.path = os.path.join(output_dir, METRICS_NAME)
        self.total_steps = total_steps
        self._file = None
        self._sinks = list(sinks or [])  # each has log(step, metrics) and close() (xorl/observability/sinks.py)
        self._bar = None
        self._t_start = time.time() - time_offset
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        keep_rows_through(self.path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                         disable=None)  # None: off when stderr is not a terminal (CI logs)

    @property
    def plain_lines(self) -> bool:
        """True when there is no progress bar (stderr is not a terminal): print a line per log."""
        return self._bar is None or self._bar.disable

    def log(self, step: int, metrics: dict[str, float], elapsed_s: float | None = None, show: bool = True) -> None:
        """One row of metrics.jsonl (and of each sink) for the step of 0-based index ``step``; a
        console line too when ``show``. The row and the sinks count it from 1 (the module docstring)."""
        if not self.enabled:
            return
        elapsed = time.time() - self._t_start if elapsed_s is None else elapsed_s
        row = {"step": step + 1, "time": round(elapsed, 3), **metrics}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for sink in self._sinks:
            sink.log(step + 1, metrics)
        if not show:
            return
        if self.plain_lines:
            print(format_step_line(row, self.total_steps), flush=True)
        else:
            self._bar.update(step + 1 - self._bar.n)
            # The bar's postfix: the console line's figures, in its format (tokens/s, MFU and memory too).
            self._bar.set_postfix_str(format_step_line(row, self.total_steps).split(" ", 2)[2])

    def note(self, text: str) -> None:
        """A line for the user (a checkpoint saved), beside the bar or among the plain lines."""
        if not self.enabled:
            return
        if self.plain_lines:
            print(text, flush=True)
        else:
            tqdm.write(text, file=sys.stderr)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._bar is not None:
            self._bar.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []


# The console line's keys, in order, with their format; a key the row lacks is left out, a null one
# (MFU where the device's peak is unknown) shows as n/a. Other keys are in metrics.jsonl and the sinks.
CONSOLE_KEYS = (("loss", ".4f"), ("eval_loss", ".4f"), ("eval_ppl", ".3g"), ("grad_norm", ".3f"), ("lr", ".2e"),
                ("router_loss", ".4f"), ("expert_load", ".2f"), ("epoch", "d"), ("data_seen", ".3f"),
                ("tokens_per_s", ".0f"), ("mfu", ".1%"), ("peak_memory_gib", ".2f"))


def format_step_line(row: dict, total_steps: int) -> str:
    """``step 10/150 loss 2.3456 grad_norm 0.812 lr 1.00e-03 epoch 1 data_seen 0.270 tokens/s 1234 mfu 41.2%
    peak_memory_gib 61.20 time 12.3s`` for a metrics.jsonl row (its step counted from 1)."""
    parts = [f"step {row['step']}/{total_steps}"]
    for key, fmt in CONSOLE_KEYS:
        if key in row:
            value = "n/a" if row[key] is None else f"{row[key]:{fmt}}"
            parts.append(f"{key.replace('_per_s', '/s')} {value}")
    parts.append(f"time {row['time']:.1f}s")
    return " ".join(parts)


def keep_rows_through(path: str, step: int) -> None:
    """Rewrite ``path`` keeping only the rows of steps 1 .. ``step`` (the checkpoint resumed from; all
    gone for 0), atomically."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(json.dumps(row) + "\n")
    write_text_atomic(path, "".join(kept))


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _active_parameters(m, n_params: int, count_of) -> str:
    """MoE: the parameters one token passes through (its top-k routed experts of each MoE layer, all
    the rest), as MoE model cards quote them ("A3B"); '' for a dense model."""
    from xorl.models.spec import ModelSpec

    spec = ModelSpec.from_config(m)
    if not spec.is_moe or not spec.num_experts:
        return ""
    h, inner = spec.hidden_size, spec.moe_intermediate_size
    per_expert = 3 * h * inner + (2 * inner + h if spec.family.expert_biases else 0)
    routed = len(spec.moe_layer_indices) * spec.num_experts * per_expert
    active = n_params - routed * (1 - spec.num_experts_per_tok / spec.num_experts)
    return f" ({count_of(round(active))} active a token)"


def _fp8_phrase(t, m, dtype: str) -> str:
    """train.fp8: which GEMMs run in FP8 (and, on an MoE model, whether the experts do)."""
    if t.fp8 == "none":
        return ""
    from xorl.nn.moe_experts import experts_run_fp8

    experts, kept = "", "lm_head"
    if m.num_experts:
        kept = "lm_head, router, shared expert"
        experts = (" and the routed experts" if experts_run_fp8(t.fp8) else
                   f"; the routed experts in {dtype} (only fp8: blockwise has an FP8 grouped GEMM)")
    return f"; FP8 {t.fp8} GEMMs in the attention and dense MLP projections{experts} ({kept} in {dtype})"


def startup_summary(config, parallel, n_params: int, start_step: int, device_type: str,
                    data_sequences: int | None = None, n_trainable: int | None = None) -> str:
    """What the run is about to do, in five lines, and a sixth with the epochs when the number of
    packed sequences in the data is known (``data_sequences``; not for streamed data). Printed by rank 0
    before the first step."""
    from xorl.config import compute_dtype
    from xorl.distributed.parallel_config import MESH_DIM_NAMES

    t, d, m = config.train, config.data, config.model
    dtype = compute_dtype(t, device_type)
    # Say what runs, not only what was asked for.
    unlike = f" (train.dtype={t.dtype} computes in bf16 on GPU under FSDP2 only)" if dtype != t.dtype else ""
    dims = " x ".join(f"{name} {size}" for name, size in zip(MESH_DIM_NAMES, parallel.mesh_shape) if size > 1)
    ep = f", expert parallel {parallel.ep}" if parallel.ep > 1 else ""
    sequences = d.micro_batch_size * t.gradient_accumulation_steps * parallel.dp
    def count_of(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e4 else str(n)

    count = f"{count_of(n_params)} parameters"
    if n_trainable is not None and n_trainable != n_params:  # LoRA: say what the optimizer updates
        how = f": LoRA rank {m.lora['rank']} on {', '.join(m.lora['target_modules'])}" if m.lora else ""
        count += f" ({count_of(n_trainable)} trainable{how})"
    lines = [
        f"xorl: {m.model_type} model, {count}{_active_parameters(m, n_params, count_of)}, {dtype} on "
        f"{device_type}{unlike}{_fp8_phrase(t, m, dtype)}",
        f"xorl: world size {parallel.world_size} = {dims or 'one process'} ({t.data_parallel_mode}{ep})",
        f"xorl: {sequences} sequences x {d.seq_len} tokens = {sequences * d.seq_len} tokens a step "
        f"(micro batch {d.micro_batch_size} x accumulation {t.gradient_accumulation_steps} x data parallel "
        f"{parallel.dp})",
        f"xorl: data {d.dataset}, tokenizer {d.tokenizer}",
        f"xorl: steps {start_step} -> {t.max_steps}, writing to {t.output_dir}",
    ]
    if data_sequences:
        epochs = t.max_steps * sequences / data_sequences
        small = (f"; fewer than one step's {sequences}: every step repeats some of them"
                 if data_sequences < sequences else "")
        plural = "s" * (data_sequences != 1)
        lines.append(f"xorl: the data packs into {data_sequences} sequence{plural}{small}; {t.max_steps} steps "
                     f"= {epochs:.3g} epochs")
    return "\n".join(lines)
